"""`model.matmul`, the hand-differentiated dot of every Dense layer: its value and gradients equal
x W, g W^T and x^T g computed in float64 numpy, and a whole model's gradient equals the one that
autodiff of flax's plain dot gives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dapo_jax import model, sharding

CONFIG = model.ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    qkv_bias=True,
    dtype="float32",
)


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
@pytest.mark.parametrize("shape", [(6, 7), (3, 5, 7)])
def test_value_and_gradients_equal_float64_numpy(dtype, tol, shape):
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, shape).astype(dtype)
    w = jax.random.normal(kw, (7, 4)).astype(dtype)
    g = jax.random.normal(kg, (*shape[:-1], 4)).astype(dtype)
    y, vjp = jax.vjp(model.matmul, x, w)
    dx, dw = vjp(g)
    x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
    assert y.dtype == dx.dtype == dw.dtype == jnp.dtype(dtype)
    assert dx.shape == x.shape and dw.shape == w.shape
    scale = lambda a: tol * max(1.0, np.abs(a).max())
    np.testing.assert_allclose(np.asarray(y, np.float64), x64 @ w64, atol=scale(x64 @ w64))
    np.testing.assert_allclose(np.asarray(dx, np.float64), g64 @ w64.T, atol=scale(g64 @ w64.T))
    dw64 = x64.reshape(-1, 7).T @ g64.reshape(-1, 4)  # summed over every token
    np.testing.assert_allclose(np.asarray(dw, np.float64), dw64, atol=scale(dw64))


def _loss_and_grad(params, tokens, mask):
    def loss(p):
        logits = model.forward(model.Transformer(CONFIG), p, tokens, mask)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0] * mask)

    return jax.value_and_grad(loss)(params)


def test_model_gradient_equals_autodiff_of_the_plain_dot(monkeypatch):
    tokens = jax.random.randint(jax.random.key(1), (3, 10), 0, CONFIG.vocab_size)
    mask = jnp.ones((3, 10), jnp.int32).at[0, :4].set(0)  # a left-padded row
    mesh = sharding.make_mesh({"data": -1}, devices=jax.devices()[:1])
    params = sharding.init_params(model.Transformer(CONFIG), mesh, jax.random.key(2))
    jaxpr = str(jax.make_jaxpr(lambda p: _loss_and_grad(p, tokens, mask))(params))
    assert "custom_vjp_call" in jaxpr  # the Dense layers run through matmul
    loss, grads = _loss_and_grad(params, tokens, mask)
    monkeypatch.setattr(model, "_dense_dot", jax.lax.dot_general)
    assert "custom_vjp_call" not in str(jax.make_jaxpr(lambda p: _loss_and_grad(p, tokens, mask))(params))
    want_loss, want_grads = _loss_and_grad(params, tokens, mask)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_only_dense_dimension_numbers_are_served():
    with pytest.raises(ValueError, match="nn.Dense's dot only"):
        model._dense_dot(jnp.ones((2, 3)), jnp.ones((2, 4)), (((0,), (0,)), ((), ())))
