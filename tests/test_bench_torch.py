"""`distill bench --torch`: the PyTorch baseline's loss is the KD loss it claims to be, and
the baseline runs on a config's shapes."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from distill.config.load import config_from_dict  # noqa: E402
from pipelines.bench.torch_ref import kd_loss, torch_kd_bench  # noqa: E402
from tests.conftest import tiny_config  # noqa: E402


def _log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.mark.parametrize("live", [None, 9])
def test_kd_loss_matches_numpy(live):
    rng = np.random.default_rng(0)
    b, s, v, alpha, temp = 2, 5, 11, 0.3, 2.0
    zs, zt = rng.normal(0, 3, (b, s, v)), rng.normal(0, 3, (b, s, v))
    targets = rng.integers(0, live or v, (b, s))
    got = kd_loss(
        torch.tensor(zs, dtype=torch.float32),
        torch.tensor(zt, dtype=torch.float32),
        torch.tensor(targets),
        alpha,
        temp,
        live,
    )
    zs, zt = zs[..., :live], zt[..., :live]
    lq, lp = _log_softmax(zs / temp), _log_softmax(zt / temp)
    kl = (np.exp(lp) * (lp - lq)).sum(-1).mean()
    ce = -np.take_along_axis(_log_softmax(zs), targets[..., None], -1).mean()
    want = alpha * temp**2 * kl + (1 - alpha) * ce
    np.testing.assert_allclose(got.item(), want, rtol=1e-5)


def test_torch_kd_bench_on_the_tiny_config(corpus_dir, tmp_path):
    cfg = config_from_dict(tiny_config(str(corpus_dir), str(tmp_path / "run")))
    r = torch_kd_bench(cfg, repeats=1)
    assert set(r) == {"torch_step_ms", "torch_tokens_per_s", "torch_threads", "torch_version"}
    assert r["torch_step_ms"] > 0 and r["torch_tokens_per_s"] > 0 and r["torch_threads"] > 0
    assert r["torch_version"] == torch.__version__
