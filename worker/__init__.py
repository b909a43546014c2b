"""The worker side: paged KV tensors, block tables, the model runner and the worker process."""
