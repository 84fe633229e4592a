"""Topic clusters of embedded documents: spherical k-means (FAISS) merged into domains.

DataKit's recipe at laptop scale: k-means on unit vectors (spherical: centroids are
renormalised each iteration, so assignment is by cosine) with K fine centroids trained on
a seeded sample, every document assigned to its nearest centroid, then the fine clusters
merged into a few domains by agglomerative clustering of their centroids (average
linkage on cosine distance): fine clusters find the structure, domains are few enough to
mix over. The report's figures (sizes, largest/smallest ratio, purity and NMI against the
source labels, silhouette) are those reference.md quotes for DataKit's failed first try.
"""

from __future__ import annotations

import numpy as np

from moelab.errors import UserError

KMEANS_ITERATIONS = 25


def check_k(k: int, sample_size: int) -> None:
    if k < 1:
        raise UserError(f"--clusters must be >= 1, got {k}")
    if k > sample_size:
        raise UserError(f"--clusters {k} is larger than the sample of {sample_size} documents; "
                        "lower --clusters or raise --sample-docs (or add documents)")


def fit_centroids(sample: np.ndarray, k: int, seed: int) -> np.ndarray:
    """float32 [k, d] unit centroids of spherical k-means on the sample's unit rows.
    One FAISS thread: with several, the order of floating-point sums (and so the
    centroids) can change between runs; determinism for a seed is the contract."""
    import faiss

    check_k(k, len(sample))
    faiss.omp_set_num_threads(1)
    kmeans = faiss.Kmeans(sample.shape[1], k, niter=KMEANS_ITERATIONS, spherical=True,
                          seed=seed, verbose=False, min_points_per_centroid=1,
                          max_points_per_centroid=1 << 30)  # no subsampling: the sample is it
    kmeans.train(np.ascontiguousarray(sample, np.float32))
    return kmeans.centroids.astype(np.float32)


def assign(vectors: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """int64 [n]: each row's nearest centroid by inner product (= cosine on unit rows)."""
    import faiss

    if len(vectors) == 0:
        return np.zeros(0, np.int64)
    index = faiss.IndexFlatIP(centroids.shape[1])
    index.add(np.ascontiguousarray(centroids, np.float32))
    return index.search(np.ascontiguousarray(vectors, np.float32), 1)[1][:, 0].astype(np.int64)


def merge_to_domains(centroids: np.ndarray, sizes: np.ndarray, n_domains: int) -> np.ndarray:
    """int64 [k]: the domain of each fine cluster. Empty fine clusters (no document) join
    the domain of their nearest non-empty one; domains are numbered largest first (by
    documents), ties by their smallest fine cluster, so the numbering is deterministic."""
    from sklearn.cluster import AgglomerativeClustering

    used = np.flatnonzero(sizes > 0)
    n_domains = max(1, min(n_domains, len(used)))
    if len(used) == 1 or n_domains == 1:
        labels = np.zeros(len(used), np.int64)
    else:
        labels = AgglomerativeClustering(n_clusters=n_domains, metric="cosine",
                                         linkage="average").fit_predict(centroids[used])
    domain = np.empty(len(centroids), np.int64)
    domain[used] = labels
    empty = np.flatnonzero(sizes == 0)
    if len(empty):
        domain[empty] = domain[used[assign(centroids[empty], centroids[used])]]
    totals = np.bincount(domain, weights=sizes, minlength=n_domains)
    first = [np.flatnonzero(domain == d).min() for d in range(n_domains)]
    order = sorted(range(n_domains), key=lambda d: (-totals[d], first[d]))
    return np.argsort(order)[domain]


def label_agreement(domains: np.ndarray, sources: np.ndarray) -> dict[str, float]:
    """Purity (each domain's majority source, summed over domains / documents) and NMI
    (scikit-learn's, arithmetic normalisation) of the domains against the source labels.
    Purity 1 with NMI near 1 means the domains just rediscover the sources."""
    from sklearn.metrics import normalized_mutual_info_score

    if len(domains) == 0:
        return {"purity": 0.0, "nmi": 0.0}
    table = np.zeros((domains.max() + 1, sources.max() + 1), np.int64)
    np.add.at(table, (domains, sources), 1)
    return {"purity": round(float(table.max(1).sum() / len(domains)), 4),
            "nmi": round(float(normalized_mutual_info_score(sources, domains)), 4)}


def silhouette(vectors: np.ndarray, labels: np.ndarray, seed: int) -> float | None:
    """Cosine silhouette of the labels on (a seeded subsample of at most 2,000) vectors;
    None when it is undefined (one label, or as many labels as points)."""
    from sklearn.metrics import silhouette_score

    n_labels = len(np.unique(labels))
    if not 2 <= n_labels < len(labels):
        return None
    return round(float(silhouette_score(vectors, labels, metric="cosine",
                                        sample_size=min(2000, len(labels)),
                                        random_state=seed)), 4)


def top_terms(texts: list[str], labels: np.ndarray, n_labels: int, n: int = 8) -> list[list[str]]:
    """Per label, the n terms of highest class-based TF-IDF (BERTopic's c-TF-IDF: a
    label's documents joined into one, weighted against the other labels') on the sample."""
    from sklearn.feature_extraction.text import CountVectorizer, TfidfTransformer

    joined = [" ".join(t for t, lab in zip(texts, labels, strict=True) if lab == d)
              for d in range(n_labels)]
    if not any(joined):
        return [[] for _ in range(n_labels)]
    vectorizer = CountVectorizer(token_pattern=r"(?u)\b[A-Za-z_][A-Za-z_]{2,}\b",
                                 max_features=50_000, stop_words="english")
    try:
        counts = vectorizer.fit_transform(joined)
    except ValueError:  # no term in any text
        return [[] for _ in range(n_labels)]
    weights = TfidfTransformer(sublinear_tf=True).fit_transform(counts).toarray()
    terms = vectorizer.get_feature_names_out()
    return [[str(terms[j]) for j in np.argsort(-row, kind="stable")[:n] if row[j] > 0]
            for row in weights]
