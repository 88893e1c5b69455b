"""The host side of flashv41: GGUF reading and writing, quant codecs, the engram hasher, the NumPy
oracle and the synthetic models. Nothing here touches the GPU."""
