"""The loader: fetch a model, install it atomically into Triton's repository, wait until it is ready."""
