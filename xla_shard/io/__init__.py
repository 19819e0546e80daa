"""The ground floor: reading and writing files on any fsspec URL, the untrusted-input rules for the JSON and
model directories read from there, and what machine this is. Everything else in xla_shard may import from
here; nothing here imports from anywhere else in xla_shard but `errors`."""
