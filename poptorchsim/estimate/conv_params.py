"""A convolution pass or matrix product as Poplar's planner sees it
(``Conv``), and the transforms its planner tries on one: expanding the
kernel into the input channels, combining conv groups, folding output
columns into channels, swapping a matrix product's operands; the input
gradient and the weight update planned as their own convolutions
(poplibs ``lib/poplin/ConvPlan.cpp``, ``ConvModel.cpp``; docs/cost_model.md).
``conv_plan`` plans them."""
from dataclasses import dataclass, replace


def cdiv(a, b):
    return -(-a // b)


@dataclass(frozen=True)
class Conv:
    """One convolution pass as Poplar plans it (all per conv group).

    ``rows`` x ``cols``: the output field (batch x output rows, output
    columns); ``in_rows`` x ``in_cols``: the input field a tile reads for the
    whole output (padding included); ``kh`` x ``kw`` the kernel positions
    each output sums over; ``stride``."""
    groups: int
    cin: int
    cout: int
    rows: int
    cols: int
    kh: int = 1
    kw: int = 1
    stride: int = 1
    in_rows: int = 0
    in_cols: int = 0
    in_bytes: int = 2          # operand element
    partial_bytes: int = 4     # partial sums: float unless half partials
    out_bytes: int = 2
    pass_name: str = "fwd"     # fwd, bwd, wu, matmul
    swap: bool = False         # operands swapped (swapOperands)
    expand: bool = False       # kernel folded into the input channels (expandDims)
    # elements per group of the tensors a rearrangement copies, where they
    # are not what the shapes say (0): the input without its padding, the
    # weight update's real operands rather than their expanded views
    in_elems: int = 0
    w_elems: int = 0
    combine: int = 1           # conv groups combined into the channels (combineConvGroups)
    # an input gradient whose output columns may fold into its output
    # channels (outChanFlattenDims): its batch, or 0
    flat_batch: int = 0
    out_flat: bool = False     # its output columns are folded into the output channels

    @property
    def macs(self):
        return self.groups * self.cin * self.cout * self.rows * self.cols * self.kh * self.kw

    @staticmethod
    def forward(groups, batch, cin, cout, h, w, kh, kw, stride, pad_h, pad_w, item, partial):
        ho = (h + 2 * pad_h - kh) // stride + 1
        wo = (w + 2 * pad_w - kw) // stride + 1
        return Conv(groups, cin, cout, batch * ho, wo, kh, kw, stride,
                    batch * (h + 2 * pad_h), w + 2 * pad_w, item, partial, item,
                    "fwd", in_elems=cin * batch * h * w).flattened()

    def flattened(self):
        """A 1x1 kernel at stride 1 sums over no neighbours: Poplar folds the
        batch and the field into one dimension (``flattenDims``)."""
        if self.kh == 1 and self.kw == 1 and self.stride == 1 and self.rows > 1:
            n = self.rows * self.cols
            return replace(self, rows=1, cols=n, in_rows=1, in_cols=n)
        return self

    def expanded(self, both):
        """Poplar's ``expandDims``: the kernel's columns (``both``: all its
        positions) folded into the input channels, the input becoming the
        output's field (an im2col); a few input channels then fill the AMP
        unit."""
        if both:
            n = self.rows * self.cols
            return replace(self, cin=self.cin * self.kh * self.kw, rows=1, cols=n, kh=1, kw=1,
                           stride=1, in_rows=1, in_cols=n, expand=True, in_elems=0)
        return replace(self, cin=self.cin * self.kw, kw=1, in_cols=self.cols,
                       in_rows=(self.rows - 1) * self.stride + self.kh, expand=True,
                       in_elems=0)

    def combine_factors(self):
        """Poplar's ``combineConvGroups`` candidates: with one input channel
        per group (or two, fp16) and several groups, ``f`` groups become one
        group of ``f`` times the channels, its weights block-diagonal, so
        that the AMP unit's channel groups fill; ``f`` runs in powers of two
        from the unit's input load width over the channels (4 halves, 2
        floats per cycle) up to its weights per unit (16 halves, 8 floats)
        (ConvPlan.cpp getCombineConvGroupCandidates)."""
        half = self.in_bytes == 2
        if self.groups < 2 or self.expand or self.cin not in ((1, 2) if half else (1,)):
            return ()
        low, high = (4 if half else 2) // self.cin, (16 if half else 8) // self.cin
        out, f = [], max(low, 1)
        while f <= high:
            out.append(f)
            f *= 2
        return tuple(out)

    def combined(self, f):
        """``f`` conv groups combined into the channels (``combineConvGroups``)."""
        return replace(self, groups=cdiv(self.groups, f), cin=self.cin * f, cout=self.cout * f,
                       combine=f, in_elems=self.in_elems * f if self.in_elems else 0)

    def out_flattened(self):
        """Poplar's ``outChanFlattenDims`` on the output columns: where the
        real input is no wider than the kernel, each output column becomes an
        output channel of a one-column convolution (swap the operands, expand
        the kernel's columns, fold them into the batch, swap back), so an
        input gradient with few output channels fills the AMP unit
        (ConvPlan.cpp getOutChanFlattenDimsCandidates, ConvModel.cpp)."""
        # the columns left are one wide with a one-wide kernel: Poplar's
        # flattenDims folds the batch into them
        b = self.flat_batch
        return replace(self, cout=self.cout * self.cols, rows=self.rows // b, cols=b,
                       in_rows=self.in_rows // b, in_cols=b, kw=1, out_flat=True, flat_batch=0)

    def input_grad(self, batch, h, w):
        """The input gradient: a convolution of the output gradient (input
        dilated by the stride, padded by the kernel less one) with the
        flipped, transposed weights; the vertex's work lists skip the
        dilation's and the padding's zeros, so each input position sums over
        about kh/stride x kw/stride positions, and never more than the
        output has."""
        s = self.stride
        # positions of the kernel that only meet the padding are never
        # visited: at most the output's extent per dimension
        kh = min(cdiv(self.kh, s), max(1, self.rows // batch))
        kw = min(cdiv(self.kw, s), self.cols)
        # outChanFlattenDims applies to a dimension whose output is not 1
        # and whose real input (this pass's: the forward's output) is no
        # larger than the kernel
        flat = batch if w > 1 and 1 < self.kw and self.cols <= self.kw else 0
        return Conv(self.groups, self.cout, self.cin, batch * h, w, kh, kw, 1,
                    self.rows + (self.kh - 1) * batch, self.cols + self.kw - 1, self.in_bytes,
                    self.partial_bytes, self.out_bytes,
                    "bwd", in_elems=self.cout * self.rows * self.cols,
                    flat_batch=flat).flattened()

    def weight_grad(self):
        """The weight update's gradient: batch and input channels swap, the
        output field is the kernel, the reduction runs over the batch and the
        output field.  Poplar expands the field into the input channels
        (``expandDims``), making it a matrix product per group:
        [kh.kw.cin] x [batch.ho.wo] x [cout]."""
        return Conv(self.groups, self.rows * self.cols, self.cout, 1, self.kh * self.kw * self.cin,
                    in_rows=1, in_cols=self.kh * self.kw * self.cin, in_bytes=self.in_bytes,
                    partial_bytes=self.partial_bytes, out_bytes=self.out_bytes, pass_name="wu",
                    in_elems=self.in_elems or self.cin * self.rows * self.cols,
                    w_elems=self.cout * self.rows * self.cols)

    @staticmethod
    def matmul(groups, m, k, n, item, partial):
        return Conv(groups, k, n, 1, m, in_rows=1, in_cols=m, in_bytes=item,
                    partial_bytes=partial, out_bytes=item, pass_name="matmul")

    def swapped(self):
        """A matrix product with its operands swapped (C^T = B^T A^T)."""
        return replace(self, cout=self.cols, cols=self.cout, in_cols=self.cout, swap=not self.swap,
                       in_elems=self.w_elems, w_elems=self.in_elems)
