"""The Batch API: its endpoints and the execution of batches (run, retry, cancel, resume)."""
