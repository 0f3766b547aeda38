"""The largest bodies the worker's control plane takes beside /weights: adapters (POST
/adapters/<id>) and training jobs (POST /train). Here, not beside their parsers (which need
torch): the HTTP server checks a body's size before any route runs."""
MAX_ADAPTER_BYTES = 256 * 1024 * 1024
MAX_TRAIN_BYTES = 256 * 1024 * 1024
