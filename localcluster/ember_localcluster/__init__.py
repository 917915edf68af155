"""The local control plane: an in-process Kubernetes API server, a process kubelet, a service proxy."""
