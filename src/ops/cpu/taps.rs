//! Where a 3x3 convolution's taps read the image, shared by the convolution drivers
//! ([`crate::ops::conv::cpu`]) and the panel kernels that read taps in place.

/// The `cin` input values under 3x3 tap `tap` (ordered (dy, dx)) of output pixel `(y, x)`,
/// or `None` where the tap falls outside the image (zero padding).
#[inline(always)]
pub(crate) fn tap_source(
    image: &[f32],
    (h, wd, cin): (usize, usize, usize),
    (y, x): (usize, usize),
    tap: usize,
) -> Option<&[f32]> {
    let (sy, sx) = ((y + tap / 3).wrapping_sub(1), (x + tap % 3).wrapping_sub(1));
    (sy < h && sx < wd).then(|| &image[(sy * wd + sx) * cin..][..cin])
}
