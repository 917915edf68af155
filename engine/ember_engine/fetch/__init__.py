"""`ember fetch-model`: a checkpoint from the Hugging Face hub, S3 or a directory, fetched resumably into a
directory and checked against the sizes and digests its source publishes.

`files` does the writing, resuming, checking and reporting; `hub`, `s3` and `local` are the sources; `cli`
is the command. No torch: it runs in an init container before the engine.
"""
