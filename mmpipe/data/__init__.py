"""The generic data layer: images, manifests, shards, the cache, samplers, the bad-sample ledger, the tokenizer."""
