"""`moelab data mix-search`: choose a mixture from small proxy runs (RegMix / DataKit).

    1. N proxies (N >= 24): weights over the components (sources, or the cells of a
       curated dataset) drawn from a flat Dirichlet; each proxy trains the same small model
       from the same init seed and data seed (common random numbers: the weights are the
       only thing that differs, so run-to-run noise does not drown their effect), then is
       scored on every source's held-out split (fixed windows, the same for all proxies).
    2. Per source j, a log-linear model  log L_j(w) = b_j . w  (no intercept: the weights
       sum to 1, so an intercept is any constant added to every b_jc), fitted with
       scikit-learn's HuberRegressor (robust to a proxy that trained badly). Its error is
       measured on the last `holdout` proxies with the model fitted on the others, then it
       is refitted on all.
    3. The objective, the mean predicted held-out loss over sources (or one target source),
       plus kl_weight x KL(w || by-size weights) (DataKit's regulariser: stay near the
       natural mixture where the proxies say little), minimised by SLSQP over the simplex
       with every weight under its epoch cap (max_epochs x tokens / the validation run's
       tokens).
    4. Validation: the chosen and the by-size mixture each trained with `seeds` new seeds
       for `validate_steps` steps and scored like the proxies.

Every proxy and validation run is a `moelab.jobs.Job`: in this process by default, or a
Ray task each with `ray=` (`--ray`), results identical either way (a run is a pure function
of its mixture and seeds). A process keeps one `ProxyRunner` per config, so the jitted
step and eval are compiled once per process (per Ray worker) and reused by every run it
trains. No checkpoints: a proxy is a measurement, not a run to resume; a Ray task lost
with its node is retried from its first step.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from moelab import outputs
from moelab.config import Config, data_dir
from moelab.data.loader import CELL_PREFIX, Loader, cells_of, read_meta, resolve_mixture
from moelab.errors import UserError
from moelab.jobs import Job, run_jobs

MIN_PROXIES = 24
TRUST = ("none", "proxies")  # mix_search's trust regions
RESULT_FILE = "mix_search.json"
RUNS_DIR = "runs"  # out/runs/<name>/: each proxy's and validation run's attempts (Ray)


def components(meta: dict, over: str) -> list[str]:
    if over == "sources":
        return list(meta["sources"])
    cells = cells_of(meta)
    if not cells:
        raise UserError("--over cells needs a curated dataset; run `moelab data curate DIR`")
    return [CELL_PREFIX + c for c in cells]


class ProxyRunner:
    """Trains cfg's model on a mixture for `steps` and scores it per source; the train and
    eval steps are compiled once for every run of the same steps."""

    def __init__(self, cfg: Config, eval_batches: int) -> None:
        import equinox as eqx

        from moelab.model import Transformer

        if cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.expert != 1:
            raise UserError("mix-search proxies run on one device; set mesh.* to 1")
        self.cfg, self.eval_batches = cfg, eval_batches
        self.meta = read_meta(cfg.data.path)
        self._steps: dict[int, tuple] = {}
        # One compiled init for every proxy (the trainer's init_sharded compiles per call,
        # which at ~1 s a compile costs more than a proxy's few dozen steps).
        self._init = eqx.filter_jit(lambda key: Transformer.init(cfg.model, cfg.moe, key))

    def _compiled(self, steps: int):
        import equinox as eqx

        from moelab.train.optimizer import make_optimizer
        from moelab.train.step import make_eval_step, make_train_step

        if steps not in self._steps:
            cfg = self.with_steps(steps)
            optimizer = make_optimizer(cfg.optim, steps, None, cfg.model.d_model)
            self._steps[steps] = (cfg, eqx.filter_jit(optimizer.init),
                                  make_train_step(cfg, optimizer), make_eval_step(cfg))
        return self._steps[steps]

    def with_steps(self, steps: int) -> Config:
        return replace(self.cfg, train=replace(self.cfg.train, steps=steps))

    def run(self, mixture: dict[str, float], steps: int, seed: int) -> dict[str, float]:
        """{source: mean held-out cross-entropy} after training `steps` on `mixture`."""
        import jax

        from moelab.train.optimizer import trainable

        cfg, opt_init, train_step, eval_step = self._compiled(steps)
        d = cfg.data
        model = self._init(jax.random.key(seed))  # as the trainer's, with train.seed = seed
        opt_state = opt_init(trainable(model))
        loader = Loader(d.path, "train", d.seq_len, d.batch_size, mixture, seed)
        for step in range(steps):
            batch = jax.numpy.asarray(loader.batch(step))
            model, opt_state, _ = train_step(model, opt_state, batch)
        losses = {}
        for source in self.meta["sources"]:
            val = Loader(d.path, "val", d.seq_len, d.batch_size, {source: 1.0}, 0)
            losses[source] = float(np.mean([float(eval_step(model, val.batch(i)))
                                            for i in range(self.eval_batches)]))
        return losses


_RUNNERS: dict[tuple[str, int], ProxyRunner] = {}  # this process's, by (config, eval batches)


def proxy_run(cfg: Config, eval_batches: int, label: str, mixture: dict[str, float],
              steps: int, seed: int) -> dict[str, float]:
    """A job's body: one run's held-out losses, on this process's compiled runner."""
    key = (repr(cfg), eval_batches)
    if key not in _RUNNERS:
        _RUNNERS[key] = ProxyRunner(cfg, eval_batches)
    losses = _RUNNERS[key].run(mixture, steps, seed)
    print(f"{label}: mean held-out loss {np.mean(list(losses.values())):.4f}", flush=True)
    return losses


def fit_loglinear(weights: np.ndarray, losses: np.ndarray):
    """One HuberRegressor per source: log loss on the weights, no intercept."""
    from sklearn.linear_model import HuberRegressor

    return [HuberRegressor(fit_intercept=False, alpha=1e-4, max_iter=1000)
            .fit(weights, np.log(losses[:, j])) for j in range(losses.shape[1])]


def predict(models: list, weights: np.ndarray) -> np.ndarray:
    """[n, sources] predicted losses."""
    w = np.atleast_2d(weights)
    return np.stack([np.exp(w @ m.coef_) for m in models], axis=1)


def choose(models: list, prior: np.ndarray, caps: np.ndarray, target: int | None,
           kl_weight: float) -> np.ndarray:
    """argmin objective(w) + kl_weight KL(w || prior) over {w >= 0, w <= caps, sum w = 1},
    by SLSQP from the prior and every vertex-ish start; the best feasible result. (A trust
    region is a tighter `caps`.)"""
    from scipy.optimize import minimize
    from scipy.special import xlogy

    coefs = np.stack([m.coef_ for m in models])  # [sources, components]

    def objective(w: np.ndarray) -> float:
        losses = np.exp(coefs @ w)
        value = losses.mean() if target is None else losses[target]
        return float(value + kl_weight * np.sum(xlogy(w, w) - xlogy(w, prior)))

    n = len(prior)
    starts = [prior, np.full(n, 1 / n), *np.eye(n) * 0.9 + 0.1 / n]
    best = None
    for start in starts:
        start = np.minimum(start, caps)
        start = start / start.sum()
        found = minimize(objective, start, method="SLSQP",
                         bounds=[(0.0, float(c)) for c in np.minimum(caps, 1.0)],
                         constraints=[{"type": "eq", "fun": lambda w: w.sum() - 1}])
        w = np.clip(found.x, 0, None)
        w = w / w.sum()
        if best is None or objective(w) < objective(best):
            best = w
    return best


def mix_search(cfg: Config, out: str | Path, over: str = "sources", proxies: int = MIN_PROXIES,
               proxy_steps: int = 40, validate_steps: int | None = None, seeds: int = 2,
               max_epochs: float = 4.0, target: str | None = None, holdout: int = 6,
               kl_weight: float = 0.05, eval_batches: int = 8, seed: int = 0,
               ray: str | None = None, cpus: float = 1.0, trust: str = "none",
               reuse: str | Path | None = None, **ray_options) -> dict:
    """Run the search; write out/mix_search.json and return it. `ray`: as `run_jobs`.

    trust: "none" optimizes over the whole capped simplex; "proxies" also keeps each weight
    at most the largest weight any proxy gave its component (the region the regression
    was fitted on: a log-linear law without interactions has its optimum at a corner, which
    no proxy may have come near). reuse: an earlier mix_search.json of the same search
    (components, proxies, steps, seed) whose proxy runs are taken instead of trained."""
    # an absolute dataset path: what a Ray worker in another directory must read
    cfg = replace(cfg, data=replace(cfg.data, path=str(data_dir(cfg.data.path).resolve())))
    meta = read_meta(cfg.data.path)
    names = components(meta, over)
    if proxies < MIN_PROXIES:
        raise UserError(f"--proxies must be >= {MIN_PROXIES} (a regression on {len(names)} "
                        f"weights needs many more runs than weights), got {proxies}")
    if not 1 <= holdout <= proxies - len(names) - 1:
        raise UserError(f"--holdout must leave more proxies than components to fit, got "
                        f"{holdout} of {proxies} with {len(names)} components")
    if target is not None and target not in meta["sources"]:
        raise UserError(f"--target {target!r} is not a source of {cfg.data.path}: "
                        f"{meta['sources']}")
    if seeds < 2:
        raise UserError(f"--seeds must be >= 2 to tell a difference from seed noise, got {seeds}")
    if trust not in TRUST:
        raise UserError(f"--trust must be one of {list(TRUST)}, got {trust!r}")
    validate_steps = validate_steps or proxy_steps
    out = Path(out).resolve()  # a file, someone else's directory: one line, before any run
    outputs.check_dir(out, ours=(out / RESULT_FILE).is_file() or (out / RUNS_DIR).is_dir())
    out.mkdir(parents=True, exist_ok=True)

    def job(name: str, weights: np.ndarray, steps: int, run_seed: int) -> Job:
        mixture = dict(zip(names, weights.tolist(), strict=True))
        return Job(name, proxy_run, (cfg, eval_batches, name, mixture, steps, run_seed),
                   run_dir=out / RUNS_DIR / name if ray is not None else None, cpus=cpus)

    sources = list(meta["sources"])
    rng = np.random.default_rng(seed)
    draws = rng.dirichlet(np.ones(len(names)), size=proxies)
    started = time.perf_counter()
    width = len(str(proxies))
    if reuse is None:
        proxy_jobs = [job(f"proxy-{i + 1:0{width}d}", w, proxy_steps, seed)
                      for i, w in enumerate(draws)]
        done = run_jobs(proxy_jobs, ray, **ray_options)
        runs = [{"weights": w.tolist(), "losses": done[j.name]}
                for w, j in zip(draws, proxy_jobs, strict=True)]
    else:
        runs = reused_runs(Path(reuse), names, proxies, proxy_steps, seed, draws)
    y = np.array([[r["losses"][s] for s in sources] for r in runs])
    fit_on = proxies - holdout
    held = predict(fit_loglinear(draws[:fit_on], y[:fit_on]), draws[fit_on:])
    errors = np.abs(held - y[fit_on:])
    models = fit_loglinear(draws, y)
    run_tokens = validate_steps * cfg.data.batch_size * cfg.data.seq_len
    by_size = resolve_mixture(meta, "train", {})  # sources by size ...
    if over == "cells":  # ... or cells by size: their train tokens
        by_size_w = np.array([cells_of(meta)[n.removeprefix(CELL_PREFIX)]["train_tokens"]
                              for n in names], float)
        prior = by_size_w / by_size_w.sum()
    else:
        prior = by_size.weights
    train_tokens = np.array(resolve_mixture(
        meta, "train", dict.fromkeys(names, 1.0)).tokens, float)
    caps = max_epochs * train_tokens / run_tokens
    bounds = caps if trust == "none" else np.minimum(caps, draws.max(axis=0))
    if bounds.sum() < 1:
        raise UserError(f"--max-epochs {max_epochs} with --trust {trust} leaves no mixture: "
                        f"the weights' bounds sum to {bounds.sum():.3f} < 1")
    t = None if target is None else sources.index(target)
    chosen = choose(models, prior, bounds, t, kl_weight)

    def objective(losses: dict[str, float]) -> float:
        return float(np.mean(list(losses.values())) if target is None else losses[target])

    def predicted(w: np.ndarray) -> float:
        row = predict(models, w)[0]
        return float(row.mean() if t is None else row[t])

    mixtures = {"chosen": chosen, "by_size": prior}
    checks = [job(f"validate-{name}-seed{seed + 1 + s}", w, validate_steps, seed + 1 + s)
              for s in range(seeds) for name, w in mixtures.items()]
    done = run_jobs(checks, ray, **ray_options)
    validation = {name: [objective(done[f"validate-{name}-seed{seed + 1 + s}"])
                         for s in range(seeds)] for name in mixtures}
    diffs = np.array(validation["chosen"]) - np.array(validation["by_size"])
    paired_se = float(diffs.std(ddof=1) / np.sqrt(seeds))
    result = {
        "components": names, "over": over, "sources": sources,
        "objective": "mean held-out loss over sources" if target is None
        else f"held-out loss of {target}",
        "proxies": proxies, "proxy_steps": proxy_steps, "validate_steps": validate_steps,
        "tokens_per_step": cfg.data.batch_size * cfg.data.seq_len,
        "model": {"d_model": cfg.model.d_model, "n_layers": cfg.model.n_layers,
                  "n_experts": cfg.moe.n_experts},
        "max_epochs": max_epochs, "epoch_caps": dict(zip(names, caps.tolist(), strict=True)),
        "kl_weight": kl_weight, "seed": seed, "trust": trust,
        "bounds": dict(zip(names, bounds.tolist(), strict=True)),
        "reused_proxies_from": None if reuse is None else str(reuse),
        "regression": {
            "model": "log L_source = b_source . w (HuberRegressor, no intercept)",
            "holdout_proxies": holdout,
            "holdout_mae": float(errors.mean()), "holdout_max_error": float(errors.max()),
            "holdout_mae_per_source": dict(zip(sources, errors.mean(0).tolist(), strict=True)),
            "proxy_loss_sd": dict(zip(sources, y.std(0, ddof=1).tolist(), strict=True)),
            "coefficients": {s: m.coef_.tolist() for s, m in zip(sources, models, strict=True)},
        },
        "chosen_weights": dict(zip(names, chosen.tolist(), strict=True)),
        "baseline_weights": dict(zip(names, prior.tolist(), strict=True)),
        "predicted_loss": predicted(chosen), "predicted_baseline_loss": predicted(prior),
        "measured_loss": float(np.mean(validation["chosen"])),
        "measured_loss_sd": float(np.std(validation["chosen"], ddof=1)),
        "baseline_loss": float(np.mean(validation["by_size"])),
        "baseline_loss_sd": float(np.std(validation["by_size"], ddof=1)),
        "validation": validation,
        "paired_difference": float(diffs.mean()), "paired_difference_se": paired_se,
        # beyond seed noise: the paired mean difference more than 2 standard errors below 0
        "beats_baseline_beyond_noise": bool(diffs.mean() < -2 * paired_se),
        "runs": runs, "seconds": round(time.perf_counter() - started, 1),
    }
    (out / RESULT_FILE).write_text(json.dumps(result, indent=1) + "\n")
    return result


def reused_runs(path: Path, names: list[str], proxies: int, steps: int, seed: int,
                draws: np.ndarray) -> list[dict]:
    """The proxy runs of an earlier search, if it is this search's: same components,
    proxy count, steps and seed, hence the same Dirichlet draws (checked)."""
    try:
        earlier = json.loads(path.read_text())
        same = (earlier["components"] == names and len(earlier["runs"]) == proxies
                and earlier["proxy_steps"] == steps and earlier["seed"] == seed
                and np.allclose([r["weights"] for r in earlier["runs"]], draws))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"--reuse-proxies {path}: not a readable mix_search.json ({err})") from None
    if not same:
        raise UserError(f"--reuse-proxies {path}: its proxies are not this search's (components, "
                        "--proxies, --proxy-steps and --seed must match)")
    return earlier["runs"]
