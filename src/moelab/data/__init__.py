"""moelab.data: real text on disk -> deduplicated, tokenized, packed shards -> batches.

    ingest      find files, read / decode / normalize / score / sign each (pure)
    text        decoding, normalization, roff stripping (pure functions)
    quality     Gopher / C4 / code heuristic scores and their thresholds
    dedup       MinHash signatures, LSH band keys, union-find clusters
    stages      the pipeline's tasks over Parquet shards, each skipped when done
    executor    local process pool or Ray Data, running a stage's tasks
    tokenizer   byte-level BPE with an EOS token
    shards      packed token streams per (source, split), Parquet files, atomic writes
    provenance  the sharded manifest (one record per document) and the stats table
    prepare     the stages in order, the default and installed corpora
    loader      mixture sampling of fixed-length windows, deterministic and resumable
"""
