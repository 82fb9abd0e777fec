"""The training forward: logits equal the serving path's, LoRA gradients equal torch autograd
through transformers + peft, the base weights are never copied, and the loss core."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import jit_forward
from peft_adapters import ALL_MODULES, EXPERT_PARAMETERS, make_peft_adapter
from tiny_models import make_hf_model, save_hf_model

from kiln.adapters import peft_io
from kiln.models.batch import RowWork, build_step_inputs
from kiln.models.decoder import init_kv_cache
from kiln.models.hf_loader import load_hf_dir
from kiln.models.loader import unstack_layers
from kiln.models.lora import empty_lora_state, set_slot
from kiln.models.weights import FUSED_TENSORS
from kiln.train import losses
from kiln.train.forward import forward_logits

ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "phi3-longrope", "gemma2", "gemma3", "mixtral",
                 "qwen2-moe", "qwen3-moe", "gpt-oss"]
MIXTURES = ("mixtral", "qwen2-moe", "qwen3-moe", "gpt-oss")
# Phi-3's PEFT adapters target its fused projections; Kiln reads each as one adapter per part.
FUSED_MODULES = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
FUSED = {suffix.split(".")[1]: parts for suffix, parts in FUSED_TENSORS.items()}


def right_padded(lengths, vocab, seed=0):
    rng = np.random.RandomState(seed)
    S = max(lengths)
    tokens = np.zeros((len(lengths), S), np.int32)
    valid = np.zeros((len(lengths), S), bool)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.randint(3, vocab, size=n)
        valid[i, :n] = True
    targets = np.roll(tokens, -1, axis=1)
    mask = (valid & np.roll(valid, -1, axis=1)).astype(np.float32)
    mask[:, :2] = 0.0  # a "prompt" that is not trained
    return tokens, valid, targets, mask


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch(request, tmp_path_factory):
    return with_peft_adapter(request.param, tmp_path_factory.mktemp(request.param))


def with_peft_adapter(variant, root):
    hf = make_hf_model(variant, seed=5)
    cfg, params, _ = load_hf_dir(save_hf_model(hf, root / "model"), np.float32, show_progress=False)
    modules = FUSED_MODULES if variant.startswith("phi3") else ALL_MODULES
    parameters = None
    if variant in MIXTURES:  # LoRA on a mixture of experts: attention and every expert
        modules, parameters = ALL_MODULES[:4], EXPERT_PARAMETERS
    peft_model = make_peft_adapter(hf, root / "adapter", rank=4, alpha=8.0, seed=7, modules=modules,
                                   parameters=parameters)
    weights, info = peft_io.read_peft(root / "adapter", cfg)
    lora = jax.tree.map(jnp.asarray, weights)
    return variant, cfg, params, peft_model, lora, info["alpha"] / info["rank"]


def torch_loss_and_grads(peft_model, tokens, valid, targets, mask, router_aux_loss_coef=0.0):
    peft_model.train()  # dropout is 0: train mode only enables autograd bookkeeping
    peft_model.zero_grad()
    out = peft_model(input_ids=torch.tensor(tokens, dtype=torch.long),
                     attention_mask=torch.tensor(valid, dtype=torch.long),
                     **({"output_router_logits": True} if router_aux_loss_coef else {}))
    logp = torch.log_softmax(out.logits.float(), -1).gather(-1, torch.tensor(targets, dtype=torch.long)[..., None])
    m = torch.tensor(mask)
    loss = -(logp[..., 0] * m).sum() / m.sum()
    if router_aux_loss_coef:  # transformers' load-balancing loss over the real tokens of every layer
        loss = loss + router_aux_loss_coef * out.aux_loss
    loss.backward()
    grads = {}
    for name, p in peft_model.named_parameters():
        if ".mlp.experts." in name and "lora_" in name:  # PEFT's layout, keyed as its files are
            grads.setdefault("experts", {})[name.replace(".default", "")] = p.grad.numpy()
        elif "lora_" in name:
            layer = int(name.split(".layers.")[1].split(".")[0])
            module = name.split(".lora_")[0].rsplit(".", 1)[1]
            part = "a" if ".lora_A." in name else "b"
            grads.setdefault(module, {}).setdefault(part, {})[layer] = p.grad.numpy().T
    peft_model.eval()
    experts = grads.pop("experts", {})
    return float(loss.detach()), {m: {k: np.stack([v[i] for i in sorted(v)]) for k, v in parts.items()}
                                  for m, parts in grads.items()} | ({"experts": experts} if experts else {})


def assert_expert_grads_equal(grads: dict, ref: dict, cfg, tmp_path, variant):
    """Kiln's expert gradients, written in PEFT's layout as an adapter's weights would be, equal
    torch's per PEFT tensor."""
    from safetensors.numpy import load_file

    experts = {m: jax.tree.map(np.asarray, grads[m]) for m in ("experts_gate_up", "experts_down")}
    out = peft_io.write_peft(tmp_path / "grads", experts, 4, 8.0, False, "", cfg.architecture)
    written = load_file(str(out / peft_io.WEIGHTS))
    assert set(written) == set(ref), (sorted(written), sorted(ref))
    for key, want in ref.items():
        rel = np.linalg.norm(written[key] - want) / np.linalg.norm(want)
        assert rel <= 1e-4, (variant, key, rel)


def test_lora_gradients_equal_torch_peft(arch, tmp_path):
    """Stacked layers (scan) on every architecture; on llama also unrolled, with and without remat;
    a mixture's experts through PEFT's target_parameters."""
    variant, cfg, stacked, peft_model, lora, scale = arch
    tokens, valid, targets, mask = right_padded([11, 7, 9], cfg.vocab_size)
    ref_loss, ref_grads = torch_loss_and_grads(peft_model, tokens, valid, targets, mask)
    ref_experts = ref_grads.pop("experts", None)
    assert (ref_experts is not None) == (variant in MIXTURES)
    layouts = [(stacked, False)] + [(unstack_layers(stacked), r) for r in (False, True)] * (variant == "llama")
    for params, remat in layouts:

        def loss_fn(lora, params=params, remat=remat):
            logits = forward_logits(params, lora, tokens, valid, cfg, scale, remat=remat)
            return losses.cross_entropy(logits, targets, mask)

        loss, grads = jax.jit(jax.value_and_grad(loss_fn))(lora)
        assert float(loss) == pytest.approx(ref_loss, rel=1e-5)
        if ref_experts is not None:
            assert_expert_grads_equal(grads, ref_experts, cfg, tmp_path, variant)
            grads = {m: g for m, g in grads.items() if not m.startswith("experts_")}
        assert set(grads) == {p for module in ref_grads for p in FUSED.get(module, (module,))}
        for module, parts in ref_grads.items():
            split = FUSED.get(module, (module,))  # a fused module's parts share its A and split its B
            fused = {"a": sum(np.asarray(grads[p]["a"]) for p in split),
                     "b": np.concatenate([np.asarray(grads[p]["b"]) for p in split], axis=-1)}
            for part, ref in parts.items():
                got = fused[part]
                rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
                assert rel <= 1e-4, (variant, module, part, rel)


@pytest.mark.parametrize("variant", ["mixtral", "qwen3-moe"])
def test_router_aux_loss_and_its_gradients_equal_transformers_peft(variant, tmp_path):
    """A mixture's load-balancing loss added to the cross-entropy (as SFT adds it with
    router_aux_loss_coef): its value on padded rows and the LoRA gradients of the sum equal
    transformers' aux_loss and torch autograd through PEFT."""
    from kiln.models.decoder import logits as lm_logits
    from kiln.train.forward import forward_hidden, load_balancing_loss

    _, cfg, params, peft_model, lora, scale = with_peft_adapter(variant, tmp_path)
    tokens, valid, targets, mask = right_padded([11, 7, 9], cfg.vocab_size)
    coef = 0.5
    ref_loss, ref_grads = torch_loss_and_grads(peft_model, tokens, valid, targets, mask, coef)

    def loss_fn(lora):
        hidden, stats = forward_hidden(params, lora, tokens, valid, cfg, scale, router_stats=True)
        logits = lm_logits(params, hidden, cfg).reshape(*tokens.shape, -1)
        return losses.cross_entropy(logits, targets, mask) + coef * load_balancing_loss(stats, valid.sum(), cfg)

    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(lora)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5)
    assert_expert_grads_equal(grads, ref_grads.pop("experts"), cfg, tmp_path, variant)
    for module, parts in ref_grads.items():
        for part, ref in parts.items():
            rel = np.linalg.norm(np.asarray(grads[module][part]) - ref) / np.linalg.norm(ref)
            assert rel <= 1e-4, (variant, module, part, rel)


def test_training_logits_equal_the_serving_path(arch):
    _, cfg, params, _, lora, scale = arch
    ids = list(np.random.RandomState(3).randint(3, cfg.vocab_size, size=21))
    state = set_slot(empty_lora_state(cfg, 2, 4), 2, jax.tree.map(np.asarray, lora), scale)
    inputs = build_step_inputs([RowWork(ids, 0, [2, 1], 2)], 16)
    served, _ = jit_forward(params, init_kv_cache(cfg, 4, 16), inputs, cfg, state)
    tokens = np.array([ids + [0, 0, 0]], np.int32)
    valid = np.array([[True] * len(ids) + [False] * 3])
    trained = forward_logits(params, lora, tokens, valid, cfg, scale)
    np.testing.assert_allclose(np.asarray(trained)[0, : len(ids)], np.asarray(served)[: len(ids)], atol=1e-5, rtol=0)


def test_loss_core_matches_direct_formulas():
    rng = np.random.RandomState(0)
    logits = jnp.asarray(rng.randn(2, 5, 7), jnp.float32)
    targets = jnp.asarray(rng.randint(0, 7, size=(2, 5)))
    mask = jnp.asarray((rng.rand(2, 5) > 0.3).astype(np.float32))
    ref = torch.nn.functional.cross_entropy(torch.tensor(np.asarray(logits)).reshape(-1, 7),
                                            torch.tensor(np.asarray(targets), dtype=torch.long).reshape(-1),
                                            reduction="none")
    m = np.asarray(mask).reshape(-1)
    assert float(losses.cross_entropy(logits, targets, mask)) == pytest.approx(float((ref.numpy() * m).sum() / m.sum()),
                                                                                rel=1e-6)
    # the clipped surrogate: ratios inside the clip range give -r A, outside the clipped bound
    lp, old = jnp.log(jnp.array([[1.5, 0.5, 1.0]])), jnp.zeros((1, 3))
    adv, ones = jnp.array([[1.0, -1.0, 2.0]]), jnp.ones((1, 3))
    per_token = [-min(1.5 * 1, 1.2 * 1), -min(0.5 * -1, 0.8 * -1), -2.0]
    assert float(losses.policy_gradient(lp, old, adv, ones)) == pytest.approx(np.mean(per_token), rel=1e-6)
    assert float(losses.policy_gradient(lp, old, jnp.array([1.0]), ones, clip_high=0.6)) == pytest.approx(
        np.mean([-1.5, -0.5, -1.0]), rel=1e-6)
    # KL estimators on samples from p: k1 and k3 are unbiased for KL(p || q), k3 >= 0
    p, q = np.array([0.6, 0.3, 0.1]), np.array([0.2, 0.5, 0.3])
    x = rng.choice(3, size=200_000, p=p)
    lp, lq = jnp.log(p[x]), jnp.log(q[x])
    kl = float(np.sum(p * np.log(p / q)))
    for est in ("k1", "k3"):
        assert float(jnp.mean(losses.kl_estimate(lp, lq, est))) == pytest.approx(kl, rel=0.02)
    assert float(jnp.min(losses.kl_estimate(lp, lq, "k3"))) >= 0
    assert float(jnp.mean(losses.kl_estimate(lp, lq, "k2"))) > 0
    # distillation: the advantage is minus the per-token reverse KL, with no gradient
    s, t = jnp.array([-1.0, -2.0]), jnp.array([-1.5, -1.0])
    np.testing.assert_allclose(losses.distillation_advantages(s, t), [-0.5, 1.0])
    assert float(jax.grad(lambda s: jnp.sum(losses.distillation_advantages(s, t)))(s).sum()) == 0.0
