"""moelab.curate: curation that trains or loads models, so it sits above train.

    pipeline    `moelab data curate`: embed, cluster and quality-bucket a dataset into cells
    embed       document embedders: lexical (TF-IDF + SVD) or neural (a moelab checkpoint)
    mixsearch   `moelab data mix-search`: mixture weights from small proxy runs
    cli         both commands, added under `moelab data`

The pure data parts they use (clusters, cells, the executor, the loader) stay in
`moelab.data`.
"""
