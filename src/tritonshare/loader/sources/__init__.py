"""Model sources by URI scheme. Importing this package fills
:data:`~tritonshare.loader.sources.base.SOURCES` with every scheme, but a source's module (and what it
imports: an XML parser, JSON, google-auth...) is loaded only when a URI of its scheme is opened: an init
container pays at start-up only for the store it reads. Once loaded, the module's ``@register`` puts its
class in place of the stand-in.
"""

from __future__ import annotations

from importlib import import_module

from tritonshare.loader.sources.base import SOURCES, Checksum, RemoteObject, Source, SourceFactory, open_source

# scheme → (module in this package, class) — the whole list of what the loader can read
SCHEMES: dict[str, tuple[str, str]] = {
    "s3": ("s3", "S3Source"),
    "gs": ("gcs", "GcsSource"),
    "http": ("http", "HttpSource"),
    "https": ("http", "HttpSource"),
    "file": ("local", "LocalSource"),
}


def _on_first_use(module: str, name: str) -> SourceFactory:
    def factory(uri: str) -> Source:
        source_class: SourceFactory = getattr(import_module(f"{__name__}.{module}"), name)
        return source_class(uri)

    return factory


for _scheme, (_module, _name) in SCHEMES.items():
    SOURCES.setdefault(_scheme, _on_first_use(_module, _name))

__all__ = ["SCHEMES", "SOURCES", "Checksum", "RemoteObject", "Source", "open_source"]
