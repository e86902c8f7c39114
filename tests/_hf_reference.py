"""Test helpers for the Hugging Face Llama conversion, written from Hugging Face's conventions and
not from learn/hf_llama.py, so that they can disagree with it: a numpy forward pass of a Llama
with Hugging Face's names, [out, in] layout and `rotate_half` rotary (float64), and a directory of
random weights in that convention, written without the module under test."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

# A tiny Llama: 2 layers, d 64, 4 heads of 16, 2 key/value heads (grouped queries), d_ff 96.
TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 1000.0, "rms_norm_eps": 1e-5}


def hf_config(tied: bool, **changes: object) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "tie_word_embeddings": tied, **TINY, **changes}


def random_hf_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under Hugging Face's names and [out, in] shapes (norm scales around 1)."""
    rng = np.random.default_rng(seed)
    d, f, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    H, G = config["num_attention_heads"], config["num_key_value_heads"]
    K = d // H

    def w(*shape: int, scale: float = 0.1) -> np.ndarray:
        return rng.normal(0.0, scale, shape).astype(np.float32)

    out = {"model.embed_tokens.weight": w(V, d, scale=0.5), "model.norm.weight": 1 + w(d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": w(H * K, d), p + "self_attn.k_proj.weight": w(G * K, d),
                    p + "self_attn.v_proj.weight": w(G * K, d), p + "self_attn.o_proj.weight": w(d, H * K),
                    p + "mlp.gate_proj.weight": w(f, d), p + "mlp.up_proj.weight": w(f, d),
                    p + "mlp.down_proj.weight": w(d, f), p + "input_layernorm.weight": 1 + w(d),
                    p + "post_attention_layernorm.weight": 1 + w(d)})
    if not config["tie_word_embeddings"]:
        out["lm_head.weight"] = w(V, d)
    return out


def write_hf_dir(directory: Path, config: dict, weights: dict[str, np.ndarray]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def hf_logits(weights: dict[str, np.ndarray], config: dict, tokens: np.ndarray) -> np.ndarray:
    """Logits [B, L, V] of Hugging Face's Llama forward pass, in float64."""
    w = {name: np.asarray(a, np.float64) for name, a in weights.items()}
    d, H, G = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    K, eps, theta = d // H, config["rms_norm_eps"], config["rope_theta"]
    B, L = tokens.shape

    def rms(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale

    inv_freq = 1.0 / theta ** (np.arange(0, K, 2) / K)
    angles = np.arange(L)[:, None] * inv_freq[None, :]
    cos = np.cos(np.concatenate([angles, angles], -1))[None, :, None, :]
    sin = np.sin(np.concatenate([angles, angles], -1))[None, :, None, :]

    def rope(x: np.ndarray) -> np.ndarray:  # rotate_half: channel j pairs with j + K/2
        rotated = np.concatenate([-x[..., K // 2:], x[..., :K // 2]], axis=-1)
        return x * cos + rotated * sin

    mask = np.tril(np.ones((L, L), bool))
    x = w["model.embed_tokens.weight"][tokens]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).reshape(B, L, H, K))
        k = np.repeat(rope((h @ w[p + "self_attn.k_proj.weight"].T).reshape(B, L, G, K)), H // G, axis=2)
        v = np.repeat((h @ w[p + "self_attn.v_proj.weight"].T).reshape(B, L, G, K), H // G, axis=2)
        scores = np.einsum("blhk,bmhk->bhlm", q, k) / np.sqrt(K)
        scores = np.where(mask, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("bhlm,bmhk->blhk", probs, v).reshape(B, L, H * K) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    x = rms(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if config["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T
