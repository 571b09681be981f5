"""Which ops AMP O1 runs in low precision: the allow / infer / deny table.

  allow  compute-heavy ops whose speed and activation memory the low precision pays for: they
         always convert (float32 ones, outside control flow, in the forward or backward pass).
  infer  cheap element-wise and layout ops: they convert when one of their float inputs already
         comes from a converted op, so a chain matmul -> bias -> relu -> matmul stays in low
         precision instead of casting back and forth -- unless one of their inputs comes
         (through infer ops) from a deny op: those stay float32 (a layer norm's h - mean).
  deny   numerically sensitive ops: exp/log, softmax and cross-entropy, reductions and norms, the
         loss. They never convert; a low-precision input is cast back to float32 before them.
Every op in none of the lists stays float32 too (a float16 input is cast back before it).

The lists are facts about numerics, the same ones NVIDIA's and TF's AMP use; ops whose float
inputs do not all share one type attribute (FusedBatchNorm: float32 scale and statistics) are
left out on purpose: the pass converts an op by switching every float32 type attribute.
"""
ALLOW = frozenset({
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
    "Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter",
    "Conv3D", "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2",
    "DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropInput",
    "DepthwiseConv2dNativeBackpropFilter",
})

INFER = frozenset({
    # element-wise arithmetic and activations (and their gradients)
    "Add", "AddV2", "AddN", "Sub", "Mul", "Neg", "Abs", "Square", "SquaredDifference",
    "BiasAdd", "BiasAddV1", "BiasAddGrad",
    "Relu", "ReluGrad", "Relu6", "Relu6Grad", "Elu", "EluGrad", "LeakyRelu", "LeakyReluGrad",
    "Selu", "SeluGrad", "Tanh", "TanhGrad", "Sigmoid", "SigmoidGrad", "Erf",
    "Maximum", "Minimum", "Select", "SelectV2", "ZerosLike", "OnesLike",
    "MaxPool", "MaxPoolGrad", "AvgPool", "AvgPoolGrad",
    # layout: no arithmetic at all
    "Identity", "Reshape", "Transpose", "ExpandDims", "Squeeze", "ConcatV2", "Split", "SplitV",
    "Slice", "StridedSlice", "StridedSliceGrad", "Pack", "Unpack", "Tile", "Pad", "PadV2",
    "GatherV2", "Gather", "BroadcastTo", "Fill",
})

DENY = frozenset({
    "Exp", "Expm1", "Log", "Log1p", "LogSoftmax", "Softmax", "Pow", "Sqrt", "Rsqrt",
    "Reciprocal", "RealDiv", "Div", "Sum", "Mean", "Prod", "L2Loss",
    "SoftmaxCrossEntropyWithLogits", "SparseSoftmaxCrossEntropyWithLogits",
    "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "FusedBatchNormGradV3",
    "Softplus", "SoftplusGrad", "Cumsum", "Norm",
})

assert not (ALLOW & INFER) and not (ALLOW & DENY) and not (INFER & DENY)


def kind(op_type):
  """"allow", "infer", "deny", or "" (not listed: stays float32)."""
  if op_type in ALLOW:
    return "allow"
  if op_type in INFER:
    return "infer"
  if op_type in DENY:
    return "deny"
  return ""
