"""The host side of flashv41 (`flashv41.host`), NumPy only: the configuration and errors, GGUF
reading and writing, the quant-type table and codecs, the engram hasher, the RoPE tables, the
NumPy oracle and the synthetic models. Nothing here touches the GPU or imports the other floors."""

if __name__ != "flashv41.host":
    raise ImportError("the host package installs as flashv41.host: import flashv41.host, not host")
