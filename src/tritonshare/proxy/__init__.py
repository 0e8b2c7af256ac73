"""The per-model proxy: forward REST and gRPC to the node's Triton for the pod's own model only."""
