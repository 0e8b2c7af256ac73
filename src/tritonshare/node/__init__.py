"""Node agents that run beside the Triton DaemonSet: advertising GPU memory to the scheduler, garbage
collection of models whose pods are gone."""
