"""The llama.cpp layer: ctypes bindings, the model and context wrappers (one raw handle each),
backend loading and llama.cpp's RPC servers. Nothing above it calls `llama_cpp` directly."""
