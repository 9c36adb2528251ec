//! Real-CUGAN (bilibili's anime upscaler, UpCunet v3), inference only.
//!
//! Two U-Nets in a row, every convolution unpadded (each 3x3 shrinks the map by a pixel a
//! side), the input reflect-padded first so that what is left is the image:
//!
//! ```text
//! x  = pro ? 0.7 x + 0.15 : x;  x reflect-padded by P (and to a multiple of M, bottom/right)
//! u1 = UNet1(x)          conv1, 2x2 stride-2 down, conv2 (+SE), 2x2 transposed up, add
//!                        conv1's centre, conv3, then conv_bottom: a transposed convolution
//!                        (4x4 stride 2, or 5x5 stride 3 for x3) that upsamples
//! u2 = UNet2(u1)         the same with one more level (and SE at three of them); its
//!                        conv_bottom is a plain 3x3
//! y  = u2 + centre of u1, cropped to s·H x s·W
//! x4 and the fast x2: y = PixelShuffle(2)(conv_final(y)) less a pixel a side,
//!                     plus nearest_s(x), the U-Nets working at twice (x4) or half
//!                     (fast x2, on the input pixel-unshuffled by 2) the input's size
//! y  = pro ? (y - 0.15) / 0.7 : y
//! ```
//!
//! | form | P | M | U-Nets' channels |
//! |---|---|---|---|
//! | x2 | 18 | 2 | image → image |
//! | x3 | 14 | 4 | image → image |
//! | x4 | 19 | 2 | image → 64 → 64 |
//! | fast x2 | 38 | 4 | 4 x image → 64 → 64 |
//!
//! Every U-Net's block (UNetConv) is two 3x3 convolutions with LeakyReLU (0.1); some end in
//! a squeeze-and-excitation gate (SEBlock: the map's mean per channel, two 1x1 convolutions,
//! ReLU between and a sigmoid after, multiplying the map), whose mean is over the whole
//! map: tiles change the output, so the tile planner keeps images whole where it can.
//!
//! How it runs here, channels last: an unpadded 3x3 convolution is the zero-padded one
//! with its border dropped (two in a row drop two pixels once: the border's errors reach
//! one pixel further per convolution, no further); the 2x2 stride-2 convolutions are a
//! product over the pixel-unshuffled map, the 2x2 stride-2 transposed ones a product
//! followed by PixelShuffle; and the 4x4 and 5x5 transposed convolutions a zero-padded 3x3
//! convolution to s² times the channels followed by PixelShuffle (each output phase reads
//! at most three input pixels a side), built from the file's weights at load
//! ([`Deconv`]). The fast x2 wants its unshuffled input's size a multiple of 2 twice over;
//! the reference pads to 2 and fails otherwise, so here it pads to 4 (M above).
//!
//! Models with other image channels load, for `info`, and are refused when built. The
//! denoising strength (`alpha`) of the reference's UNet2 is 1 in every released model's
//! inference, as the reference loader runs it.

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::VarBuilder;
use serde::Serialize;
use serde_json::json;

use crate::nets::frame::{nearest, pixel_unshuffle};
use crate::nets::infer::{check_shapes, tensor, ConfigError, Shapes};
use crate::nets::registry::Architecture;
use crate::nets::{ArchConfig, Net, NetConfig};
use crate::ops::conv::transposed::Deconv;
use crate::ops::conv::{pixel_shuffle_nhwc_reordered, Act, Conv3x3};
use crate::ops::cpu as kernels;
use crate::ops::cpu::Centre;
use crate::ops::gate::ChannelGate;
use crate::ops::linear::Dense;
use crate::ops::pad::Pad;
use crate::ops::{add, crop, LoadPlan};

/// Every LeakyReLU's negative slope.
const SLOPE: f32 = 0.1;
/// The squeeze-and-excitation gates' channel reduction.
const SE_REDUCTION: usize = 8;
/// What the pro models map the input range [0, 1] to: `PRO_SCALE · x + PRO_SHIFT`.
const PRO_SCALE: f64 = 0.7;
const PRO_SHIFT: f64 = 0.15;

/// Which of the reference's four networks a file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Form {
    /// UpCunet2x.
    #[serde(rename = "x2")]
    X2,
    /// UpCunet3x.
    #[serde(rename = "x3")]
    X3,
    /// UpCunet4x.
    #[serde(rename = "x4")]
    X4,
    /// UpCunet2x_fast: the U-Nets at half the input's size.
    #[serde(rename = "x2 fast")]
    X2Fast,
}

impl Form {
    fn scale(self) -> usize {
        match self {
            Self::X2 | Self::X2Fast => 2,
            Self::X3 => 3,
            Self::X4 => 4,
        }
    }

    /// The reflect padding on every side, and the multiple the padded size keeps.
    fn padding(self) -> (usize, usize) {
        match self {
            Self::X2 => (18, 2),
            Self::X3 => (14, 4),
            Self::X4 => (19, 2),
            Self::X2Fast => (38, 4),
        }
    }

    /// Whether the network ends in `conv_final` and PixelShuffle with the nearest-upscaled
    /// input added.
    fn has_final(self) -> bool {
        matches!(self, Self::X4 | Self::X2Fast)
    }
}

/// Real-CUGAN's configuration, read from its weights.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RealCuganConfig {
    pub form: Form,
    /// Image channels in.
    pub in_channels: usize,
    /// Image channels out.
    pub out_channels: usize,
    /// A pro model (the file holds a `pro` tensor): its input range is remapped.
    pub pro: bool,
}

impl RealCuganConfig {
    /// The configuration read from the tensor names and shapes, every tensor checked. The
    /// form follows the reference loader: `conv_final` means x4, or the fast x2 where the
    /// first convolution reads four times the output's channels; otherwise a 5x5
    /// transposed convolution ends UNet1 at x3, and a 4x4 one at x2.
    pub fn infer(shapes: &Shapes) -> std::result::Result<Self, ConfigError> {
        let first = tensor(shapes, "unet1.conv1.conv.0.weight")?;
        if first.len() != 4 {
            return Err(ConfigError::shape(
                "unet1.conv1.conv.0.weight",
                first,
                "; expected a 3x3 convolution's weight",
            ));
        }
        let mut in_channels = first[1];
        let (form, out_channels) = if let Some(fin) = shapes.get("conv_final.weight") {
            let out = fin.first().copied().unwrap_or(0) / 4;
            if out * 4 == in_channels {
                in_channels = out;
                (Form::X2Fast, out)
            } else {
                (Form::X4, out)
            }
        } else {
            let bottom = tensor(shapes, "unet1.conv_bottom.weight")?;
            let out = tensor(shapes, "unet2.conv_bottom.weight")?
                .first()
                .copied()
                .unwrap_or(0);
            match bottom.get(2) {
                Some(5) => (Form::X3, out),
                _ => (Form::X2, out),
            }
        };
        if in_channels == 0 || out_channels == 0 {
            return Err(ConfigError::shape(
                "unet1.conv1.conv.0.weight",
                first,
                ": no image channels",
            ));
        }
        let cfg = Self {
            form,
            in_channels,
            out_channels,
            // The fast x2 has no pro form: there `pro` is a tensor too many.
            pro: form != Form::X2Fast && shapes.contains_key("pro"),
        };
        check_shapes(
            &cfg.expected_tensors(),
            shapes,
            " (not in this Real-CUGAN form)",
        )?;
        Ok(cfg)
    }

    /// UNet1's and UNet2's channels in and out.
    fn unet_channels(&self) -> ((usize, usize), (usize, usize)) {
        let (c, o) = (self.in_channels, self.out_channels);
        match self.form {
            Form::X2 | Form::X3 => ((c, o), (o, o)),
            Form::X4 => ((c, 64), (64, 64)),
            Form::X2Fast => ((4 * c, 64), (64, 64)),
        }
    }

    /// UNet1's last transposed convolution: (kernel, stride, padding).
    fn bottom(&self) -> (usize, usize, usize) {
        match self.form {
            Form::X3 => (5, 3, 2),
            _ => (4, 2, 3),
        }
    }
}

/// The tensors of a convolution `(cout, cin, k, k)` with its bias.
fn conv(t: &mut Vec<(String, Vec<usize>)>, name: &str, (cin, cout, k): (usize, usize, usize)) {
    t.push((format!("{name}.weight"), vec![cout, cin, k, k]));
    t.push((format!("{name}.bias"), vec![cout]));
}

/// The tensors of a transposed convolution `(cin, cout, k, k)` with its bias.
fn deconv(t: &mut Vec<(String, Vec<usize>)>, name: &str, (cin, cout, k): (usize, usize, usize)) {
    t.push((format!("{name}.weight"), vec![cin, cout, k, k]));
    t.push((format!("{name}.bias"), vec![cout]));
}

/// A UNetConv's tensors: two 3x3 convolutions, and the gate's two 1x1 ones when `se`.
fn unet_conv(
    t: &mut Vec<(String, Vec<usize>)>,
    name: &str,
    (cin, mid, cout): (usize, usize, usize),
    se: bool,
) {
    conv(t, &format!("{name}.conv.0"), (cin, mid, 3));
    conv(t, &format!("{name}.conv.2"), (mid, cout, 3));
    if se {
        let r = cout / SE_REDUCTION;
        conv(t, &format!("{name}.seblock.conv1"), (cout, r, 1));
        conv(t, &format!("{name}.seblock.conv2"), (r, cout, 1));
    }
}

impl NetConfig for RealCuganConfig {
    fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let ((c1, o1), (c2, o2)) = self.unet_channels();
        let mut t = Vec::new();
        unet_conv(&mut t, "unet1.conv1", (c1, 32, 64), false);
        conv(&mut t, "unet1.conv1_down", (64, 64, 2));
        unet_conv(&mut t, "unet1.conv2", (64, 128, 64), true);
        deconv(&mut t, "unet1.conv2_up", (64, 64, 2));
        conv(&mut t, "unet1.conv3", (64, 64, 3));
        deconv(&mut t, "unet1.conv_bottom", (64, o1, self.bottom().0));
        unet_conv(&mut t, "unet2.conv1", (c2, 32, 64), false);
        conv(&mut t, "unet2.conv1_down", (64, 64, 2));
        unet_conv(&mut t, "unet2.conv2", (64, 64, 128), true);
        conv(&mut t, "unet2.conv2_down", (128, 128, 2));
        unet_conv(&mut t, "unet2.conv3", (128, 256, 128), true);
        deconv(&mut t, "unet2.conv3_up", (128, 128, 2));
        unet_conv(&mut t, "unet2.conv4", (128, 64, 64), true);
        deconv(&mut t, "unet2.conv4_up", (64, 64, 2));
        conv(&mut t, "unet2.conv5", (64, 64, 3));
        conv(&mut t, "unet2.conv_bottom", (64, o2, 3));
        if self.form.has_final() {
            conv(&mut t, "conv_final", (64, 4 * self.out_channels, 3));
        }
        if self.pro {
            t.push(("pro".into(), vec![1]));
        }
        t
    }

    /// Each layer's multiply-adds a pixel at the resolution it runs at, relative to the
    /// padded input (UNet1 at 1/4 of it in the fast x2, UNet2 at s² times, or 4 times in
    /// x4 and once in the fast x2); borders ignored.
    fn flops(&self, h: usize, w: usize) -> f64 {
        let ((c1, o1), (c2, o2)) = self.unet_channels();
        let (k, s, _) = self.bottom();
        let conv = |cin: usize, cout: usize| (9 * cin * cout) as f64;
        let unet1 = conv(c1, 32)
            + conv(32, 64)
            + (64 * 64) as f64
            + (conv(64, 128) + conv(128, 64) + (64 * 64 * 4) as f64) / 4.0
            + conv(64, 64)
            + (64 * o1 * k * k) as f64;
        let unet2 = conv(c2, 32)
            + conv(32, 64)
            + (64 * 64) as f64
            + (conv(64, 64) + conv(64, 128) + (128 * 128) as f64) / 4.0
            + (conv(128, 256) + conv(256, 128) + (128 * 128 * 4) as f64) / 16.0
            + (conv(128, 64) + conv(64, 64) + (64 * 64 * 4) as f64) / 4.0
            + conv(64, 64)
            + conv(64, o2);
        let (at1, at2) = match self.form {
            Form::X2Fast => (0.25, 1.0),
            _ => (1.0, (s * s) as f64),
        };
        let last = if self.form.has_final() {
            at2 * conv(64, 4 * self.out_channels)
        } else {
            0.0
        };
        2.0 * (at1 * unet1 + at2 * unet2 + last) * (h * w) as f64
    }

    fn family(&self) -> &'static str {
        "Real-CUGAN"
    }

    fn variant(&self) -> &'static str {
        match (self.form, self.pro) {
            (Form::X2, false) => "Real-CUGAN x2",
            (Form::X2, true) => "Real-CUGAN pro x2",
            (Form::X3, false) => "Real-CUGAN x3",
            (Form::X3, true) => "Real-CUGAN pro x3",
            (Form::X4, false) => "Real-CUGAN x4",
            (Form::X4, true) => "Real-CUGAN pro x4",
            (Form::X2Fast, _) => "Real-CUGAN fast x2",
        }
    }

    fn scale(&self) -> usize {
        self.form.scale()
    }

    fn window(&self) -> usize {
        self.form.padding().1
    }

    fn describe(&self) -> serde_json::Value {
        json!({
            "scale": self.form.scale(),
            "form": self.form,
            "pro": self.pro,
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
        })
    }

    /// UNet2's widest maps: 64 channels at the input's pixels (fast x2), at four times them
    /// (x2; x4, whose UNet2 works at twice the input's size and whose UNet1 ends in 4 x 64
    /// channels before its shuffle) or at nine times (x3).
    fn largest_tensor_per_pixel(&self, _: bool, _: Pad) -> usize {
        match self.form {
            Form::X2Fast => 64,
            Form::X2 | Form::X4 => 64 * 4,
            Form::X3 => 64 * 9,
        }
    }

    /// At UNet2's top level: UNet1's output (kept for the final sum), conv1's output, the
    /// upsampled map, their sum, conv5's output and the convolutions' working buffers, 64
    /// channels each at UNet2's resolution; x4 also holds UNet1's 64-channel output and
    /// conv_final's. A whole process's peak at 512x512 measured 1310 (x2), 3370 (x3), 1970
    /// (x4) and 440 (fast x2) f32 values per padded input pixel; these are 15-20% above.
    fn activations_per_pixel(&self, _: bool, _: Pad) -> f64 {
        match self.form {
            Form::X2 => 6.0 * 64.0 * 4.0,
            Form::X3 => 7.0 * 64.0 * 9.0,
            Form::X4 => 9.0 * 64.0 * 4.0,
            Form::X2Fast => 8.0 * 64.0,
        }
    }

    fn refusal(&self) -> Option<String> {
        (self.in_channels != 3 || self.out_channels != 3).then(|| {
            format!(
                "a Real-CUGAN model with {} input and {} output channels: only RGB models (3) run",
                self.in_channels, self.out_channels
            )
        })
    }

    /// The squeeze-and-excitation gates take each map's mean.
    fn whole_input_matters(&self) -> bool {
        true
    }

    fn build(&self, plan: &LoadPlan, vb: VarBuilder) -> Result<Box<dyn Net>> {
        Ok(Box::new(RealCugan::new(self, plan, vb)?))
    }
}

/// `x` less `t` pixels on every side, plus `y`: the crop and the sum one pass on the CPU.
fn crop_plus(x: &Tensor, t: usize, y: &Tensor) -> Result<Tensor> {
    if let Some(sum) = kernels::centre(x, t, Centre::Plus(y))? {
        return Ok(sum);
    }
    add(&crop(x, t)?, y)
}

/// UNetConv: two unpadded 3x3 convolutions, each with LeakyReLU, and the gate.
struct UNetConv {
    a: Conv3x3,
    b: Conv3x3,
    /// SEBlock: `x · sigmoid(conv2(relu(conv1(mean(x)))))`.
    se: Option<ChannelGate>,
}

impl UNetConv {
    fn new(
        (cin, mid, cout): (usize, usize, usize),
        se: bool,
        plan: &LoadPlan,
        vb: VarBuilder,
    ) -> Result<Self> {
        Ok(Self {
            a: Conv3x3::unpadded(cin, mid, plan, vb.pp("conv.0"))?,
            b: Conv3x3::unpadded(mid, cout, plan, vb.pp("conv.2"))?,
            se: se
                .then(|| {
                    let vb = vb.pp("seblock");
                    ChannelGate::new((cout, cout / SE_REDUCTION), vb.pp("conv1"), vb.pp("conv2"))
                })
                .transpose()?,
        })
    }

    /// The map less two pixels a side, gated.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let lrelu = Act::Leaky(SLOPE);
        let y = self.b.forward_act(&self.a.forward_act(x, lrelu)?, lrelu)?;
        match &self.se {
            Some(se) => se.forward_centre(&y, 2),
            None => crop(&y, 2),
        }
    }
}

/// A 2x2 convolution with stride 2: a product over the map's 2x2 blocks, each read as one
/// row in (i, j, c) order ([`kernels::space_to_depth`]), the weight reordered to match.
struct Down(Dense);

impl Down {
    fn new(c: usize, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let w = vb.get((c, c, 2, 2), "weight")?;
        let w = w.permute((0, 2, 3, 1))?.reshape((c, 4 * c))?.contiguous()?;
        Ok(Self(Dense::new(w, vb.get(c, "bias")?, plan)?))
    }

    /// Followed by LeakyReLU, as every one is.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let blocks = match kernels::space_to_depth(x, 2)? {
            Some(y) => y,
            None => {
                let (b, h, w, c) = x.dims4()?;
                x.reshape((b, h / 2, 2, w / 2, 2, c))?
                    .permute((0, 1, 3, 2, 4, 5))?
                    .contiguous()?
                    .reshape((b, h / 2, w / 2, 4 * c))?
            }
        };
        self.0.forward_leaky(&blocks, SLOPE)
    }
}

/// A 2x2 transposed convolution with stride 2: a product to the four output pixels of each
/// input pixel, in (i, j, c) order, then PixelShuffle.
struct Up(Dense);

impl Up {
    fn new(c: usize, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let w = vb.get((c, c, 2, 2), "weight")?;
        let w = w.permute((2, 3, 1, 0))?.reshape((4 * c, c))?.contiguous()?;
        let b = vb.get(c, "bias")?;
        let b = Tensor::cat(&[&b, &b, &b, &b], 0)?;
        Ok(Self(Dense::new(w, b, plan)?))
    }

    /// Followed by LeakyReLU, as every one is (applied before the shuffle, which only
    /// moves values).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        pixel_shuffle_nhwc_reordered(&self.0.forward_leaky(x, SLOPE)?, 2)
    }
}

/// UNet1: one level down and up, then the upsampling transposed convolution.
struct UNet1 {
    conv1: UNetConv,
    down1: Down,
    conv2: UNetConv,
    up2: Up,
    conv3: Conv3x3,
    bottom: Deconv,
}

impl UNet1 {
    fn new(cfg: &RealCuganConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let ((c, o), _) = cfg.unet_channels();
        Ok(Self {
            conv1: UNetConv::new((c, 32, 64), false, plan, vb.pp("conv1"))?,
            down1: Down::new(64, plan, vb.pp("conv1_down"))?,
            conv2: UNetConv::new((64, 128, 64), true, plan, vb.pp("conv2"))?,
            up2: Up::new(64, plan, vb.pp("conv2_up"))?,
            conv3: Conv3x3::unpadded(64, 64, plan, vb.pp("conv3"))?,
            bottom: Deconv::new((64, o), cfg.bottom(), plan, vb.pp("conv_bottom"))?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x1 = self.conv1.forward(x)?;
        let x2 = self.down1.forward(&x1)?;
        let x2 = self.up2.forward(&self.conv2.forward(&x2)?)?;
        let x3 = self
            .conv3
            .forward_act(&crop_plus(&x1, 4, &x2)?, Act::Leaky(SLOPE))?;
        self.bottom.forward(&crop(&x3, 1)?)
    }
}

/// UNet2: two levels down and up, then a 3x3 convolution.
struct UNet2 {
    conv1: UNetConv,
    down1: Down,
    conv2: UNetConv,
    down2: Down,
    conv3: UNetConv,
    up3: Up,
    conv4: UNetConv,
    up4: Up,
    conv5: Conv3x3,
    bottom: Conv3x3,
}

impl UNet2 {
    fn new(cfg: &RealCuganConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let (_, (c, o)) = cfg.unet_channels();
        Ok(Self {
            conv1: UNetConv::new((c, 32, 64), false, plan, vb.pp("conv1"))?,
            down1: Down::new(64, plan, vb.pp("conv1_down"))?,
            conv2: UNetConv::new((64, 64, 128), true, plan, vb.pp("conv2"))?,
            down2: Down::new(128, plan, vb.pp("conv2_down"))?,
            conv3: UNetConv::new((128, 256, 128), true, plan, vb.pp("conv3"))?,
            up3: Up::new(128, plan, vb.pp("conv3_up"))?,
            conv4: UNetConv::new((128, 64, 64), true, plan, vb.pp("conv4"))?,
            up4: Up::new(64, plan, vb.pp("conv4_up"))?,
            conv5: Conv3x3::unpadded(64, 64, plan, vb.pp("conv5"))?,
            bottom: Conv3x3::unpadded(64, o, plan, vb.pp("conv_bottom"))?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x1 = self.conv1.forward(x)?;
        let x2 = self.down1.forward(&x1)?;
        let x2 = self.conv2.forward(&x2)?;
        let x3 = self.down2.forward(&x2)?;
        let x3 = self.up3.forward(&self.conv3.forward(&x3)?)?;
        let x4 = self
            .up4
            .forward(&self.conv4.forward(&crop_plus(&x2, 4, &x3)?)?)?;
        let x5 = self
            .conv5
            .forward_act(&crop_plus(&x1, 16, &x4)?, Act::Leaky(SLOPE))?;
        // conv5 and conv_bottom unpadded: two pixels a side, dropped once.
        crop(&self.bottom.forward(&x5)?, 2)
    }
}

pub struct RealCugan {
    unet1: UNet1,
    unet2: UNet2,
    /// conv_final, its outputs ordered for PixelShuffle by 2 (x4 and the fast x2).
    last: Option<Conv3x3>,
    form: Form,
    pro: bool,
    dtype: DType,
}

impl RealCugan {
    /// The network stored under `vb`, built as `plan` says.
    pub fn new(cfg: &RealCuganConfig, plan: &LoadPlan, vb: VarBuilder) -> Result<Self> {
        let last = cfg
            .form
            .has_final()
            .then(|| {
                Conv3x3::shuffled_with_bias(
                    64,
                    (cfg.out_channels, 2),
                    true,
                    plan,
                    vb.pp("conv_final"),
                )
            })
            .transpose()?;
        Ok(Self {
            unet1: UNet1::new(cfg, plan, vb.pp("unet1"))?,
            unet2: UNet2::new(cfg, plan, vb.pp("unet2"))?,
            last,
            form: cfg.form,
            pro: cfg.pro,
            dtype: vb.dtype(),
        })
    }
}

/// `x` `(B, H, W, C)` reflect-padded (the edge not repeated) by `top`, `left` and
/// `bottom`, `right`; maps smaller than the padding fold back and forth.
fn reflect_pad(
    x: &Tensor,
    (top, bottom): (usize, usize),
    (left, right): (usize, usize),
) -> Result<Tensor> {
    let (_, h, w, _) = x.dims4()?;
    let indices = |n: usize, before: usize, after: usize| -> Vec<u32> {
        let period = 2 * (n.max(2) - 1) as isize;
        (0..before + n + after)
            .map(|i| {
                if n == 1 {
                    return 0;
                }
                let m = (i as isize - before as isize).rem_euclid(period);
                (if m < n as isize { m } else { period - m }) as u32
            })
            .collect()
    };
    let rows = Tensor::from_vec(indices(h, top, bottom), top + h + bottom, x.device())?;
    let cols = Tensor::from_vec(indices(w, left, right), left + w + right, x.device())?;
    x.index_select(&rows, 1)?.index_select(&cols, 2)
}

impl Net for RealCugan {
    fn dtype(&self) -> DType {
        self.dtype
    }

    #[cfg(test)]
    fn cached_masks(&self) -> usize {
        0
    }
}

impl Module for RealCugan {
    /// `x`: `(B, C, H, W)` in [0, 1], any H and W; returns `(B, C, sH, sW)` unclamped.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (_, _, h, w) = x.dims4()?;
        let s = self.form.scale();
        let x = x.to_dtype(self.dtype)?;
        let x = if self.pro {
            x.affine(PRO_SCALE, PRO_SHIFT)?
        } else {
            x
        };
        let x = x.permute((0, 2, 3, 1))?.contiguous()?;
        let (p, m) = self.form.padding();
        let (hp, wp) = (h.div_ceil(m) * m, w.div_ceil(m) * m);
        let mut u = reflect_pad(&x, (p, p + hp - h), (p, p + wp - w))?;
        if self.form == Form::X2Fast {
            u = pixel_unshuffle(&u, 2)?;
        }
        let u1 = self.unet1.forward(&u)?;
        let u2 = self.unet2.forward(&u1)?;
        let y = crop_plus(&u1, 20, &u2)?;
        let y = match &self.last {
            // conv_final unpadded and a pixel a side dropped after it: two input pixels,
            // four shuffled ones, a side.
            Some(last) => {
                let y = last.forward_shuffled(&y, 2)?;
                let y = y.narrow(1, 4, h * s)?.narrow(2, 4, w * s)?;
                add(&y.contiguous()?, &nearest(&x, s)?)?
            }
            None => y.narrow(1, 0, h * s)?.narrow(2, 0, w * s)?,
        };
        let y = if self.pro {
            ((y - PRO_SHIFT)? / PRO_SCALE)?
        } else {
            y
        };
        y.permute((0, 3, 1, 2))?.contiguous()
    }
}

/// Real-CUGAN's registry entry.
pub(crate) struct Arch;

impl Architecture for Arch {
    fn name(&self) -> &'static str {
        "Real-CUGAN"
    }

    fn loads(&self) -> &'static str {
        "x2, x3, x4, pro and fast x2"
    }

    /// Two U-Nets, `unet1.*` and `unet2.*`, which no other registered network has.
    fn detect(&self, shapes: &Shapes) -> bool {
        shapes.keys().any(|k| k.starts_with("unet1."))
            && shapes.keys().any(|k| k.starts_with("unet2."))
    }

    fn infer(&self, shapes: &Shapes) -> std::result::Result<ArchConfig, ConfigError> {
        match RealCuganConfig::infer(shapes) {
            Ok(c) => Ok(std::sync::Arc::new(c)),
            Err(e) => Err(ConfigError::RealCugan(Box::new(e))),
        }
    }
}
