//! The frame DRCT, SwinIR, Swin2SR and HAT share around their bodies, written once:
//!
//! ```text
//! x  = reflect-pad(x) to a window multiple, channels-last, minus the RGB mean
//! f0 = conv_first(x)                       3x3, 3 -> E
//! t  = patch_embed.norm(f0)                when the model has a patch norm (Swin2SR's
//!                                          after its 1x1 patch_embed.proj)
//! t  = body(t)                             the architecture's own groups
//! b  = conv_after_body(norm(t)) + f0       identity, one 3x3, or SwinIR's 3conv
//! y  = tail(b) + mean                      pixel shuffle, one-step shuffle, nearest+conv,
//!                                          or Swin2SR's aux (which also reads x)
//! ```
//!
//! then cropped to `(sH, sW)` and back to channels-first. A network builds its [`Frame`]
//! from its configuration and supplies only the body.
//!
//! The restoration models (SwinIR's denoising and JPEG models, Swin2SR's JPEG one) have no
//! upsampler: their tail is `x + conv_last(b)`, the input plus a correction. Those with
//! window 7 (the JPEG ones) scale the centred input by 255 before `conv_first` and divide by
//! it at the end.

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::VarBuilder;

use crate::nets::swin::{load_norm, reflect_pad_bottom_right};
use crate::nets::Net;
use crate::ops::conv::{Act, Conv3x3};
use crate::ops::linear::{pointwise_with, Dense};
use crate::ops::norm::{layer_norm, Norm};
use crate::ops::pad::{Channels, Pad};
use crate::ops::windows::WindowCache;
use crate::ops::{add, LoadPlan};

/// The RGB mean the official models subtract (img_range 1.0); not stored in checkpoints.
const RGB_MEAN: [f32; 3] = [0.4488, 0.4371, 0.4040];
/// `nn.LeakyReLU()`'s default slope, used after `conv_before_upsample`.
const UPSAMPLE_SLOPE: f64 = 0.01;
/// Slope of the LeakyReLUs inside SwinIR's 3conv connection and nearest+conv upsampler.
pub(crate) const SLOPE: f64 = 0.2;

/// The convolution after the body's norm (and, in SwinIR, after each residual group).
pub(crate) enum AfterBody {
    /// No convolution: the norm's output goes straight to the residual sum.
    Identity,
    /// One 3x3 convolution ("1conv").
    One(Conv3x3),
    /// 3x3 to E/4, LeakyReLU, 1x1, LeakyReLU, 3x3 back to E ("3conv": `0`, `2`, `4`).
    Three(Conv3x3, Dense, Conv3x3),
}

impl AfterBody {
    /// SwinIR's 3conv connection on `e` channels, a quarter of them inside.
    pub(crate) fn three(e: usize, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let q = e / 4;
        Ok(Self::Three(
            Conv3x3::unpadded(e, q, plan, vb.pp("0"))?,
            pointwise_with(q, q, plan, vb.pp("2"))?,
            Conv3x3::unpadded(q, e, plan, vb.pp("4"))?,
        ))
    }
}

impl Module for AfterBody {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Identity => Ok(x.clone()),
            Self::One(c) => c.forward(x),
            Self::Three(a, b, c) => {
                let y = candle_nn::ops::leaky_relu(&a.forward(x)?, SLOPE)?;
                let y = candle_nn::ops::leaky_relu(&b.forward(&y)?, SLOPE)?;
                c.forward(&y)
            }
        }
    }
}

/// The upsampler after the body, the RGB mean folded into its last convolution's bias.
pub(crate) enum Tail {
    /// A 3x3 to the features, LeakyReLU, pixel-shuffle stages, `conv_last`.
    PixelShuffle {
        before: Conv3x3,
        stages: Vec<(Conv3x3, usize)>,
        last: Conv3x3,
    },
    /// One 3x3 straight to `3 * s * s` channels and one pixel shuffle (`upsample.0`).
    Direct { conv: Conv3x3, scale: usize },
    /// Nearest-neighbour x2 steps, each followed by a 3x3 (`conv_up1`, `conv_up2`), then
    /// `conv_hr` and `conv_last`.
    NearestConv {
        before: Conv3x3,
        ups: Vec<Conv3x3>,
        hr: Conv3x3,
        last: Conv3x3,
    },
    /// No upsampler (restoration at scale 1): `conv_last` gives a correction that the frame
    /// adds to the network's input. Its bias holds no mean.
    Residual { last: Conv3x3 },
    /// Swin2SR's compressed-input upsampler (`pixelshuffle_aux`): as [`Tail::PixelShuffle`],
    /// but between `conv_before_upsample` and the stages an RGB image (`conv_aux`) is made and
    /// read back (`conv_after_aux`), and the bicubic resize of the network's input, through
    /// `conv_bicubic`, is added to the stages' output before `conv_last`.
    Aux(Box<AuxTail>),
}

/// The layers of [`Tail::Aux`].
pub(crate) struct AuxTail {
    bicubic: Conv3x3,
    before: Conv3x3,
    aux: Conv3x3,
    after_aux: Conv3x3,
    stages: Vec<(Conv3x3, usize)>,
    last: Conv3x3,
    scale: usize,
}

impl Tail {
    /// `conv_before_upsample.0` from the body's `e` channels to `f` (`num_feat` real ones),
    /// the stages `upsample.0`, `upsample.2`, ... of the factors in `stages`, their outputs
    /// padded as `pad` says, and `conv_last` back to RGB.
    pub(crate) fn pixel_shuffle(
        (e, f, num_feat): (&Channels, &Channels, usize),
        stages: Vec<usize>,
        pad: Pad,
        plan: &LoadPlan,
        vb: &VarBuilder,
    ) -> Result<Self> {
        let stages = stages
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                let vb = vb.pp(format!("upsample.{}", 2 * i));
                Ok((Conv3x3::shuffled(f, (num_feat, r), pad, plan, vb)?, r))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self::PixelShuffle {
            before: Conv3x3::new(e, f, plan, vb.pp("conv_before_upsample.0"))?,
            stages,
            last: Conv3x3::new(f, &Pad::OFF.one(3), plan, vb.pp("conv_last"))?
                .add_to_bias(&mean(vb)?.flatten_all()?)?,
        })
    }

    /// `upsample.0` from `e` channels straight to `3 * scale²`, one shuffle.
    pub(crate) fn direct(e: usize, scale: usize, plan: &LoadPlan, vb: &VarBuilder) -> Result<Self> {
        // After reordering, output channel (i*s + j)*3 + c is colour c of sub-pixel (i, j):
        // the mean repeats once per sub-pixel.
        let tiled = mean(vb)?.flatten_all()?.repeat(scale * scale)?;
        let e = Pad::OFF.one(e);
        let conv = Conv3x3::shuffled(&e, (3, scale), Pad::OFF, plan, vb.pp("upsample.0"))?
            .add_to_bias(&tiled)?;
        Ok(Self::Direct { conv, scale })
    }

    /// `conv_before_upsample.0` from `e` to `f` channels, `conv_upK` for each doubling of
    /// `scale`, `conv_hr` and `conv_last`.
    pub(crate) fn nearest_conv(
        (e, f): (usize, usize),
        scale: usize,
        plan: &LoadPlan,
        vb: &VarBuilder,
    ) -> Result<Self> {
        Ok(Self::NearestConv {
            before: Conv3x3::unpadded(e, f, plan, vb.pp("conv_before_upsample.0"))?,
            ups: (1..=scale.trailing_zeros())
                .map(|k| Conv3x3::unpadded(f, f, plan, vb.pp(format!("conv_up{k}"))))
                .collect::<Result<Vec<_>>>()?,
            hr: Conv3x3::unpadded(f, f, plan, vb.pp("conv_hr"))?,
            last: Conv3x3::unpadded(f, 3, plan, vb.pp("conv_last"))?
                .add_to_bias(&mean(vb)?.flatten_all()?)?,
        })
    }

    /// Swin2SR's `pixelshuffle_aux` from the body's `e` channels through `f` to RGB, the
    /// stages of the factors in `stages` (see [`Tail::Aux`]).
    pub(crate) fn aux(
        (e, f): (usize, usize),
        stages: Vec<usize>,
        plan: &LoadPlan,
        vb: &VarBuilder,
    ) -> Result<Self> {
        let scale = stages.iter().product();
        let stages = stages
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                let vb = vb.pp(format!("upsample.{}", 2 * i));
                let conv = Conv3x3::shuffled(&Pad::OFF.one(f), (f, r), Pad::OFF, plan, vb)?;
                Ok((conv, r))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self::Aux(Box::new(AuxTail {
            bicubic: Conv3x3::unpadded(3, f, plan, vb.pp("conv_bicubic"))?,
            before: Conv3x3::unpadded(e, f, plan, vb.pp("conv_before_upsample.0"))?,
            aux: Conv3x3::unpadded(f, 3, plan, vb.pp("conv_aux"))?,
            after_aux: Conv3x3::unpadded(3, f, plan, vb.pp("conv_after_aux.0"))?,
            stages,
            last: Conv3x3::unpadded(f, 3, plan, vb.pp("conv_last"))?
                .add_to_bias(&mean(vb)?.flatten_all()?)?,
            scale,
        })))
    }

    /// The tail of `b`, the body's output, for a network whose (centred, scaled) input was
    /// `x`: only [`Tail::Aux`] reads it.
    pub(crate) fn forward_from(&self, b: &Tensor, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Aux(t) => t.forward(b, x),
            _ => self.forward(b),
        }
    }

    /// `conv_last` from the body's `e` channels to the image's `c` (RGB, or SwinIR's
    /// greyscale models' one): the restoration models' correction.
    pub(crate) fn residual(
        (e, c): (usize, usize),
        plan: &LoadPlan,
        vb: &VarBuilder,
    ) -> Result<Self> {
        Ok(Self::Residual {
            last: Conv3x3::unpadded(e, c, plan, vb.pp("conv_last"))?,
        })
    }
}

impl Module for Tail {
    fn forward(&self, b: &Tensor) -> Result<Tensor> {
        let lrelu = candle_nn::ops::leaky_relu;
        match self {
            Self::PixelShuffle {
                before,
                stages,
                last,
            } => {
                let mut y = lrelu(&before.forward(b)?, UPSAMPLE_SLOPE)?;
                for (conv, r) in stages {
                    y = conv.forward_shuffled(&y, *r)?;
                }
                last.forward(&y)
            }
            Self::Direct { conv, scale } => conv.forward_shuffled(b, *scale),
            Self::NearestConv {
                before,
                ups,
                hr,
                last,
            } => {
                let mut y = lrelu(&before.forward(b)?, UPSAMPLE_SLOPE)?;
                for up in ups {
                    y = lrelu(&up.forward(&nearest(&y, 2)?)?, SLOPE)?;
                }
                last.forward(&lrelu(&hr.forward(&y)?, SLOPE)?)
            }
            Self::Residual { last } => last.forward(b),
            Self::Aux(_) => candle_core::bail!("the aux upsampler needs the network's input"),
        }
    }
}

impl AuxTail {
    /// The reference's `pixelshuffle_aux` branch on an input `x` that is a window multiple
    /// (the frame pads it): its bicubic resize is then exactly x`scale`, and no crop falls
    /// between the stages and `conv_last`.
    fn forward(&self, b: &Tensor, x: &Tensor) -> Result<Tensor> {
        let (_, h, w, _) = x.dims4()?;
        let hr = crate::ops::resize::bicubic(x, (h * self.scale, w * self.scale))?;
        let hr = self.bicubic.forward(&hr)?;
        let y = self
            .before
            .forward_act(b, Act::Leaky(UPSAMPLE_SLOPE as f32))?;
        let rgb = self.aux.forward(&y)?;
        let mut y = self
            .after_aux
            .forward_act(&rgb, Act::Leaky(UPSAMPLE_SLOPE as f32))?;
        for (conv, r) in &self.stages {
            y = conv.forward_shuffled(&y, *r)?;
        }
        self.last.forward(&add(&y, &hr)?)
    }
}

/// `x` `(B, H, W, C)` repeated to `(B, rH, rW, C)` (nearest-neighbour upsampling by `r`).
pub(crate) fn nearest(x: &Tensor, r: usize) -> Result<Tensor> {
    let (b, h, w, c) = x.dims4()?;
    x.reshape((b, h, 1, w, 1, c))?
        .broadcast_as((b, h, r, w, r, c))?
        .contiguous()?
        .reshape((b, r * h, r * w, c))
}

/// `x` `(B, H, W, C)` pixel-unshuffled by `r` to `(B, H/r, W/r, C·r²)`, channels in
/// PyTorch's order: channel `c·r² + i·r + j` is colour `c` of sub-pixel `(i, j)`.
pub(crate) fn pixel_unshuffle(x: &Tensor, r: usize) -> Result<Tensor> {
    let (b, h, w, c) = x.dims4()?;
    x.reshape((b, h / r, r, w / r, r, c))?
        .permute((0, 1, 3, 5, 2, 4))?
        .contiguous()?
        .reshape((b, h / r, w / r, c * r * r))
}

/// `x` `(B, C, H, W)` in `dtype`, reflect-padded (bottom, right) to a multiple of `m` as the
/// reference pipelines pad, channels-last `(B, H', W', C)`; and `(H, W)`, for [`crop_nchw`].
pub(crate) fn padded_nhwc(x: &Tensor, dtype: DType, m: usize) -> Result<(Tensor, (usize, usize))> {
    let (_, _, h, w) = x.dims4()?;
    let x = reflect_pad_bottom_right(&x.to_dtype(dtype)?, m)?;
    Ok((x.permute((0, 2, 3, 1))?, (h, w)))
}

/// `y` `(B, H', W', C)` cropped to `(h, w)` and channels-first, contiguous: a network's
/// output less its padding.
pub(crate) fn crop_nchw(y: &Tensor, (h, w): (usize, usize)) -> Result<Tensor> {
    y.narrow(1, 0, h)?
        .narrow(2, 0, w)?
        .permute((0, 3, 1, 2))?
        .contiguous()
}

/// [`RGB_MEAN`] as the `(1, 1, 1, 3)` tensor the networks subtract and add back, in `vb`'s
/// dtype and on its device.
fn mean(vb: &VarBuilder) -> Result<Tensor> {
    Tensor::from_vec(RGB_MEAN.to_vec(), (1, 1, 1, 3), vb.device())?.to_dtype(vb.dtype())
}

/// Everything around a network's body; see the module's documentation.
pub(crate) struct Frame {
    pub(super) mean: Tensor,
    pub(super) conv_first: Conv3x3,
    /// Swin2SR's 1x1 `patch_embed.proj` in front of the patch norm.
    pub(super) patch_proj: Option<Dense>,
    pub(super) patch_norm: Option<Norm>,
    pub(super) norm: Norm,
    pub(super) after_body: AfterBody,
    pub(super) tail: Tail,
    pub(super) dtype: DType,
    pub(super) window: usize,
    pub(super) scale: usize,
    /// What the centred input is multiplied by before `conv_first`, and the output divided
    /// by at the end (the reference's `img_range`: 255 for SwinIR's JPEG models, else 1).
    pub(super) range: f64,
}

impl Frame {
    /// The frame stored under `vb`: `conv_first` to the `e` channels, `patch_embed.norm`
    /// when `patch_norm`, the body's `norm`, and the given convolution after it and tail;
    /// inputs padded to multiples of `window`, outputs `scale` times larger.
    pub(crate) fn new(
        (e, patch_norm): (&Channels, bool),
        (after_body, tail): (AfterBody, Tail),
        (window, scale): (usize, usize),
        plan: &LoadPlan,
        vb: &VarBuilder,
    ) -> Result<Self> {
        Self::with_channels(
            (e, patch_norm),
            (after_body, tail),
            (window, scale, 3),
            plan,
            vb,
        )
    }

    /// [`Frame::new`] for an image of `channels`: 3 (RGB, less its mean), or 1 (SwinIR's
    /// greyscale models, which subtract none).
    pub(crate) fn with_channels(
        (e, patch_norm): (&Channels, bool),
        (after_body, tail): (AfterBody, Tail),
        (window, scale, channels): (usize, usize, usize),
        plan: &LoadPlan,
        vb: &VarBuilder,
    ) -> Result<Self> {
        let mean = if channels == 3 {
            mean(vb)?
        } else {
            Tensor::zeros((1, 1, 1, channels), vb.dtype(), vb.device())?
        };
        Ok(Self {
            mean,
            // The image's channels are never padded.
            conv_first: Conv3x3::new(&Pad::OFF.one(channels), e, plan, vb.pp("conv_first"))?,
            patch_proj: None,
            patch_norm: if patch_norm {
                Some(load_norm(e, vb.pp("patch_embed.norm"))?)
            } else {
                None
            },
            norm: load_norm(e, vb.pp("norm"))?,
            after_body,
            tail,
            dtype: vb.dtype(),
            window,
            scale,
            range: 1.0,
        })
    }

    /// The same frame with the input scaled by `range` (see [`Frame::range`]).
    pub(crate) fn with_range(self, range: f64) -> Self {
        Self { range, ..self }
    }

    /// The same frame with a 1x1 projection (Swin2SR's `patch_embed.proj`) between
    /// `conv_first` and the patch norm.
    pub(crate) fn with_patch_proj(self, proj: Dense) -> Self {
        Self {
            patch_proj: Some(proj),
            ..self
        }
    }

    /// `y` divided by the range the input was scaled by (unchanged at range 1).
    fn undo_range(&self, y: Tensor) -> Result<Tensor> {
        if self.range == 1.0 {
            Ok(y)
        } else {
            y / self.range
        }
    }

    /// The dtype the network computes in.
    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    /// `x` `(B, 3, H, W)` RGB in [0, 1], any H and W, through the frame with `body` between
    /// the shallow features and the norm; returns `(B, 3, sH, sW)` in the network's dtype,
    /// unclamped. The bottom/right reflect padding to a window multiple is the official test
    /// pipelines'; its output is cropped away.
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        body: impl FnOnce(Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        // Channels-last from here on: every layer is a matmul over the channel axis.
        let (x, (h, w)) = padded_nhwc(x, self.dtype, self.window)?;
        let x = x.broadcast_sub(&self.mean)?;
        let x = if self.range == 1.0 {
            x
        } else {
            (x * self.range)?
        };
        let f0 = self.conv_first.forward(&x)?;
        let t = match &self.patch_proj {
            Some(proj) => proj.forward(&f0)?,
            None => f0.clone(),
        };
        let t = match &self.patch_norm {
            Some(norm) => layer_norm(norm, &t)?,
            None => t,
        };
        let t = body(t)?;
        let b = add(&self.after_body.forward(&layer_norm(&self.norm, &t)?)?, &f0)?;
        // The restoration tail's correction is added to the (centred, scaled) input as the
        // reference adds it; the SR tails add the mean in their last bias, which a range
        // other than 1 must leave out of its division.
        let y = match (&self.tail, self.range == 1.0) {
            (Tail::Residual { .. }, _) => self
                .undo_range(add(&x, &self.tail.forward(&b)?)?)?
                .broadcast_add(&self.mean)?,
            (tail, true) => tail.forward_from(&b, &x)?,
            (tail, false) => self
                .undo_range(tail.forward_from(&b, &x)?.broadcast_sub(&self.mean)?)?
                .broadcast_add(&self.mean)?,
        };
        crop_nchw(&y, (h * self.scale, w * self.scale))
    }
}

/// A Swin-family network: the [`Frame`] around a body of residual groups `G` (DRCT's,
/// SwinIR's or HAT's), run one after another.
pub struct SwinNet<G> {
    pub(crate) frame: Frame,
    pub(crate) groups: Vec<G>,
    /// Shared with every block; kept here to report its size.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) windows: WindowCache,
    pad: Pad,
}

impl<G> SwinNet<G> {
    /// The frame, the body's groups, the blocks' shared window cache, and how the channels
    /// were padded at load.
    pub(crate) fn assemble(frame: Frame, groups: Vec<G>, windows: WindowCache, pad: Pad) -> Self {
        Self {
            frame,
            groups,
            windows,
            pad,
        }
    }
}

impl<G: Module + Send + Sync> Net for SwinNet<G> {
    fn dtype(&self) -> DType {
        self.frame.dtype()
    }

    fn padding(&self) -> Pad {
        self.pad
    }

    #[cfg(test)]
    fn cached_masks(&self) -> usize {
        self.windows.len()
    }
}

impl<G: Module> Module for SwinNet<G> {
    /// `x`: `(B, 3, H, W)` RGB in [0, 1], any H and W; see [`Frame::forward`].
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.frame.forward(x, |mut t| {
            for group in &self.groups {
                t = group.forward(&t)?;
            }
            Ok(t)
        })
    }
}
