"""Model files, read and written: checkpoints users have (Hugging Face directories, GGUF,
nanoGPT: checkpoints, convert, the gguf* modules, tokenizer_import) and the mdi model directory
mdi-prepare makes of them and every node loads (prepare, store, model_dir, gguf_export). What a
model is once loaded (config, layout, transformer) stays in mdi.model.
"""
