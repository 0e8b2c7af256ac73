"""tritonshare: many model pods sharing one Triton Inference Server per GPU node."""

__version__ = "0.1.0"
