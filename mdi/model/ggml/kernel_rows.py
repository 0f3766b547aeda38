"""The pass sizes at which ggml-cpu changes how it computes a sample's rows, and so their bits:
what the starter's prompt cuts (mdi.starter.prompt_passes) and runtime.prefill_weights' auto
rule (mdi.model.ggml.dequant_rows) both follow, so that a prompt row's bits depend on its
window alone, never on how its passes were cut."""
TILED_ROWS = 64  # ggml-cpu's GGML_FA_TILE_Q: from this many query rows its flash attention is the tiled kernel
REPACK_ROWS = 4  # re-laid weights (runtime.repack) multiply a pass's rows in groups of 4 (the rest one by one)
UBATCH = 512  # llama.cpp's default n_ubatch: the passes it cuts a prompt into, and so the starter on ggml
KV_PAD = 256  # llama.cpp pads its KV cells, and the view of them attended, to a multiple of this
