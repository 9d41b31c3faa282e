"""The linear probe of benchmarks/sentence_embeddings.py, and how much of what it reads is noise.

Two probes on frozen embeddings, trained on the same SST-2 training sentences and tested on the 872 SST-2 validation
sentences:

* `fixed`: scikit-learn's LogisticRegression at C=1 on the embeddings as they are (the protocol of the first runs).
  all-MiniLM-L6-v2's embeddings are unit vectors (each feature about 0.05), so C=1 regularises this probe hard and
  it reads the embeddings' scale as much as what they hold.
* `tuned`: features standardised, C picked by 5-fold cross-validation on the probe's training rows alone (SentEval's
  protocol: the test sentences never choose C), the same procedure for every model.

Noise: the test set is 872 sentences, so one accuracy near 0.78 has a standard error of about 0.014 (1.4 points)
from the test sentences alone. `bootstrap` gives that standard error, and the paired one of the difference between
two models on the same sentences (which is what "KD beats no KD" asks), by resampling the test sentences.
"""

from __future__ import annotations

import numpy as np

CS = (0.001, 0.01, 0.1, 1.0, 10.0)


def probe_predictions(train_x, train_y, test_x, kind: str = "tuned") -> tuple[np.ndarray, float | None]:
    """The probe's predictions on `test_x` and the C it used (`tuned` picks it by cross-validation on the
    training rows)."""
    from sklearn.linear_model import LogisticRegression, LogisticRegressionCV
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x, t = np.asarray(train_x, dtype=np.float64), np.asarray(test_x, dtype=np.float64)
    if kind == "fixed":
        clf = LogisticRegression(C=1.0, max_iter=3000).fit(x, train_y)
        return clf.predict(t), 1.0
    if kind != "tuned":
        raise ValueError(f"probe kind {kind!r} is not fixed or tuned")
    clf = make_pipeline(StandardScaler(), LogisticRegressionCV(Cs=list(CS), cv=5, max_iter=3000))
    clf.fit(x, train_y)
    return clf.predict(t), float(clf[-1].C_[0])


def bootstrap(correct: np.ndarray, other: np.ndarray | None = None, rounds: int = 2000, seed: int = 0) -> dict:
    """Standard error of the accuracy (mean of `correct`, 0/1 per test sentence) over resampled test sets, and,
    with `other` (another model's 0/1 on the same sentences), the paired standard error of the difference."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(correct), size=(rounds, len(correct)))
    out = {"se": float(correct[idx].mean(axis=1).std(ddof=1))}
    if other is not None:
        diff = correct.astype(np.float64) - other
        out["diff"] = float(diff.mean())
        out["diff_se"] = float(diff[idx].mean(axis=1).std(ddof=1))
    return out


def subset_spread(train_x, train_y, test_x, test_y, size: int, draws: int = 5, seed: int = 0) -> list[float]:
    """Tuned-probe accuracies from `draws` random `size`-row subsets of the probe's training rows: how much the
    choice of training sentences alone moves the probe."""
    rng = np.random.default_rng(seed)
    x, y = np.asarray(train_x), np.asarray(train_y)
    accs = []
    for _ in range(draws):
        pick = rng.choice(len(x), size=size, replace=False)
        pred, _ = probe_predictions(x[pick], y[pick], test_x)
        accs.append(float((pred == np.asarray(test_y)).mean()))
    return accs
