"""moelab.data: real text on disk -> deduplicated, tokenized, packed shards -> batches.

    ingest      find files, read / decode / normalize / sign each (pure, parallel)
    text        decoding, normalization, roff stripping (pure functions)
    dedup       exact (hash) and near (MinHash LSH) duplicate removal
    tokenizer   byte-level BPE with an EOS token
    shards      packed token streams per (source, split), written atomically
    provenance  manifest.jsonl (one record per document) and the stats table
    prepare     the pipeline, the default corpus
    loader      mixture sampling of fixed-length windows, deterministic and resumable
"""
