"""Model sources by URI scheme. Importing this package registers every scheme in
:data:`~tritonshare.loader.sources.base.SOURCES`; each module imports its SDK (boto3,
google-cloud-storage) only when a source of its kind is used, so the import stays cheap.
"""

from tritonshare.loader.sources import gcs, http, local, s3
from tritonshare.loader.sources.base import SOURCES, Checksum, RemoteObject, Source, open_source

__all__ = ["SOURCES", "Checksum", "RemoteObject", "Source", "gcs", "http", "local", "open_source", "s3"]
