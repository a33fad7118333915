"""Every Triton kernel compiles for an H100 (sm_90) on this CPU-only machine.

The interpreter runs Python, so it accepts code the real compiler rejects (type changes of loop
variables, Python ints where tensors are needed, unsupported dtypes in tl.dot...). Triton ships
ptxas, so `triton.compile` can build the cubin ahead of time without a GPU: this lane catches those
errors before a GPU ever sees the code. Production tile sizes and dtypes (bf16 inputs, fp32 stats).
"""
import pytest

triton = pytest.importorskip("triton", reason="triton not installed")
if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
    pytest.skip(f"ahead-of-time compile lane written against triton 3.9's API (have {triton.__version__})",
                allow_module_level=True)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import dispatch, logprobs, norms, rotary, sampling, swiglu  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")  # Triton 3.9 notice
tl = triton.language
H100 = GPUTarget("cuda", 90, 32)
I32, F32, BF16, P_BF16, P_F32, P_I64 = "i32", "fp32", "bf16", "*bf16", "*fp32", "*i64"


ALIGNED = ("H", "D", "C", "HALF")  # sizes that are multiples of 16 in real models


def build(kernel, types, constexprs, num_warps=4, num_stages=3):
    """Compile to a cubin. Pointers, strides and hidden sizes get the divisibility-by-16 hint that
    Triton's launcher adds at run time for such values (it enables the pipelined K loop)."""
    if dispatch.interpret_mode():
        pytest.skip("this process runs Triton in interpreter mode")
    signature = {**types, **{name: "constexpr" for name in constexprs}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(types.items())
             if ty.startswith("*") or name.startswith("stride") or name in ALIGNED}
    src = ASTSource(kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=H100, options={"num_warps": num_warps, "num_stages": num_stages})
    assert compiled.asm["cubin"], "no cubin"
    return compiled


LOGPROB_TYPES = dict(h_ptr=P_BF16, w_ptr=P_BF16, b_ptr=P_BF16, t_ptr=P_I64)
LOGPROB_TILES = dict(ACC=tl.float32, PRECISION=None, BLOCK_N=128, BLOCK_V=128, BLOCK_H=64)  # logprobs._tiles


@pytest.mark.parametrize("bias,entropy", [(False, True), (True, False)])
def test_logprobs_forward_compiles(bias, entropy):
    types = dict(**LOGPROB_TYPES, m_ptr=P_F32, s_ptr=P_F32, a_ptr=P_F32, zt_ptr=P_F32, N=I32, V=I32, H=I32,
                 stride_h=I32, stride_w=I32, v_per_split=I32, n_split=I32, inv_temp=F32, ignore_index=I32)
    build(logprobs._fwd_kernel, types, dict(HAS_BIAS=bias, ENTROPY=entropy, **LOGPROB_TILES), 8, 3)


@pytest.mark.parametrize("bias,entropy", [(False, True), (True, False)])
def test_logprobs_dlogits_compiles(bias, entropy):
    types = dict(**LOGPROB_TYPES, lse_ptr=P_F32, ez_ptr=P_F32, glp_ptr=P_F32, gent_ptr=P_F32, dz_ptr=P_BF16,
                 N=I32, V=I32, H=I32, stride_h=I32, stride_w=I32, stride_dz=I32, inv_temp=F32)
    build(logprobs._dlogits_kernel, types, dict(HAS_BIAS=bias, ENTROPY=entropy, **LOGPROB_TILES), 8, 3)


def test_logprobs_fp32_ieee_compiles():
    types = dict(h_ptr=P_F32, w_ptr=P_F32, b_ptr=P_F32, t_ptr=P_I64, m_ptr=P_F32, s_ptr=P_F32, a_ptr=P_F32,
                 zt_ptr=P_F32, N=I32, V=I32, H=I32, stride_h=I32, stride_w=I32, v_per_split=I32, n_split=I32,
                 inv_temp=F32, ignore_index=I32)
    build(logprobs._fwd_kernel, types, dict(HAS_BIAS=True, ENTROPY=True, ACC=tl.float32, PRECISION="ieee",
                                            BLOCK_N=64, BLOCK_V=128, BLOCK_H=32), 8, 3)


@pytest.mark.parametrize("rms,res,bias", [(True, True, False), (False, True, True), (False, False, False)])
def test_norm_kernels_compile(rms, res, bias):
    fwd = dict(x_ptr=P_BF16, r_ptr=P_BF16, w_ptr=P_BF16, b_ptr=P_BF16, y_ptr=P_BF16, s_ptr=P_BF16,
               rstd_ptr=P_F32, mean_ptr=P_F32, D=I32, stride_x=I32, stride_r=I32, eps=F32)
    build(norms._norm_fwd_kernel, fwd, dict(RMS=rms, HAS_RES=res, HAS_BIAS=bias, ACC=tl.float32, BLOCK=4096), 8)
    bwd = dict(dy_ptr=P_BF16, ds_ptr=P_BF16, x_ptr=P_BF16, w_ptr=P_BF16, rstd_ptr=P_F32, mean_ptr=P_F32,
               dx_ptr=P_BF16, dw_ptr=P_F32, db_ptr=P_F32, N=I32, D=I32, stride_dy=I32, stride_ds=I32,
               stride_x=I32, rows_per_program=I32)
    build(norms._norm_bwd_kernel, bwd, dict(RMS=rms, HAS_DS=res, HAS_BIAS=bias, ACC=tl.float32, BLOCK=4096), 8)


@pytest.mark.parametrize("backward", [False, True])
def test_rotary_compiles(backward):
    types = dict(x_ptr=P_BF16, cos_ptr=P_BF16, sin_ptr=P_BF16, y_ptr=P_BF16, T=I32, NH=I32, HALF=I32,
                 sx_b=I32, sx_h=I32, sx_t=I32, sc_b=I32, sc_t=I32, ss_b=I32, ss_t=I32)
    build(rotary._rope_kernel, types, dict(BACKWARD=backward, ACC=tl.float32, BLOCK_H=32, BLOCK_D=64))


def test_swiglu_compiles():
    build(swiglu._swiglu_fwd_kernel, dict(g_ptr=P_BF16, u_ptr=P_BF16, y_ptr=P_BF16, C=I32, stride_g=I32,
                                          stride_u=I32), dict(ACC=tl.float32, BLOCK=1024))
    build(swiglu._swiglu_bwd_kernel, dict(g_ptr=P_BF16, u_ptr=P_BF16, dy_ptr=P_BF16, dg_ptr=P_BF16, du_ptr=P_BF16,
                                          C=I32, stride_g=I32, stride_u=I32, stride_dy=I32),
          dict(ACC=tl.float32, BLOCK=1024))


@pytest.mark.parametrize("greedy,top_k,top_p", [(True, False, False), (False, False, False), (False, True, True)])
def test_sampling_compiles(greedy, top_k, top_p):
    types = dict(z_ptr=P_BF16, u_ptr=P_F32, tok_ptr=P_I64, lp_ptr=P_F32, V=I32, stride_z=I32, stride_u=I32,
                 temp=F32, top_k=I32, top_p=F32)
    build(sampling._sample_kernel, types, dict(GREEDY=greedy, TOP_K=top_k, TOP_P=top_p, BLOCK_V=4096), 8)


def test_fp64_dot_compiles():
    """fp64 inputs (used by the interpreter tests) also build for the GPU."""
    types = dict(h_ptr="*fp64", w_ptr="*fp64", b_ptr="*fp64", t_ptr=P_I64, lse_ptr="*fp64", ez_ptr="*fp64",
                 glp_ptr="*fp64", gent_ptr="*fp64", dz_ptr="*fp64", N=I32, V=I32, H=I32, stride_h=I32, stride_w=I32,
                 stride_dz=I32, inv_temp=F32)
    build(logprobs._dlogits_kernel, types, dict(HAS_BIAS=False, ENTROPY=True, ACC=tl.float64, PRECISION="ieee",
                                                BLOCK_N=16, BLOCK_V=32, BLOCK_H=16), 4, 1)

