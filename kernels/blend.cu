// Weighted accumulation of one tile's model output into a device canvas.
//
// The canvas is (C + 1) planes of out_h x out_w f32: C weighted sums and, last, the weight
// sum. The tile's weight at (i, j) is wy[i] * wx[j] (separable blend profiles). Each thread
// owns one output pixel of the tile, so tiles added one launch after another on a stream
// never race, and their order per pixel is the launch order.
//
// The arithmetic mirrors the host accumulator exactly: explicit round-to-nearest intrinsics
// keep the compiler from contracting w * v + acc into an FMA (which rounds once, not twice),
// and a zero weight skips the pixel, so crop-and-paste copies values bit-exactly and
// non-finite values in discarded margins never reach the canvas.

extern "C" __global__ void blend_add_f32(
    float *__restrict__ canvas,
    const float *__restrict__ tile,     // C x th x tw, contiguous
    const float *__restrict__ weights,  // wy (th values) then wx (tw values)
    unsigned int channels,
    unsigned int th,
    unsigned int tw,
    unsigned int out_h,
    unsigned int out_w,
    unsigned int oy,
    unsigned int ox)
{
    const unsigned int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= tw) {
        return;
    }
    const size_t plane = (size_t)out_h * out_w;
    const size_t src_plane = (size_t)th * tw;
    // Rows stride by the grid height, which the launcher caps at the hardware limit.
    for (unsigned int i = blockIdx.y; i < th; i += gridDim.y) {
        const float w = __fmul_rn(weights[i], weights[th + j]);
        if (w == 0.0f) {
            continue;
        }
        const size_t dst = (size_t)(oy + i) * out_w + (ox + j);
        const size_t src = (size_t)i * tw + j;
        for (unsigned int c = 0; c < channels; ++c) {
            float *acc = canvas + c * plane + dst;
            *acc = __fadd_rn(*acc, __fmul_rn(w, tile[c * src_plane + src]));
        }
        float *wsum = canvas + channels * plane + dst;
        *wsum = __fadd_rn(*wsum, w);
    }
}
