"""The gateway's durable state, one SQLite file under `--data-dir`: the Batch API's files, batches and lines
(`batch_store`, with `batch_input` and `batch_files`), the Responses API's kept responses (`response_store`),
and the schema both share (`schema`). Stdlib only."""
