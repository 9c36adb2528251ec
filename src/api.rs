//! The library's front door: open a DRCT model once, then upscale images held in memory.
//!
//! ```
//! use upscale::{Options, Upscaler};
//!
//! // The embedded default model (x4) on the CPU; `Upscaler::open(Some(path), ..)` takes
//! // official `.pth` or `.safetensors` weights.
//! let opts = Options { device: upscale::DeviceChoice::Cpu, ..Options::default() };
//! let up = Upscaler::open(None, &opts)?;
//! let small = image::DynamicImage::ImageRgb8(image::RgbImage::from_fn(24, 16, |x, y| {
//!     image::Rgb([(x * 10) as u8, (y * 15) as u8, 128])
//! }));
//! let big = up.upscale(&small)?;
//! assert_eq!((big.width(), big.height()), (96, 64));
//! # Ok::<(), upscale::Error>(())
//! ```
//!
//! Everything the command-line tool does per image happens here too: tiling with Hann
//! blending, alpha and grayscale handling, 8- or 16-bit output following the input. File
//! metadata is not: a `DynamicImage` holds no ICC profile or EXIF, so carrying them is the
//! caller's part (the command-line tool carries both).

use std::path::Path;

use image::DynamicImage;

use crate::engine::image::Upscaled;
use crate::engine::lanes::Lanes;
use crate::engine::{choose_dtype, open_device, read_checkpoint, DeviceChoice, Precision};
use crate::error::{Error, ErrorKind};
use crate::io::{Decoded, EncodeOptions, Format, IoError};
use crate::ops::attention::Attention;
use crate::planar::Planar;
use crate::size::OutputSize;
use crate::tile::auto::{TileChoice, TileSettings};
use crate::tile::BlendMode;

/// How to run the model. `Options::default()` is what the command line does without flags
/// (a test holds the two equal).
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// CPU, a GPU, several GPUs, or the first GPU that answers (else the CPU).
    pub device: DeviceChoice,
    /// `Auto` is bf16 on a GPU and fp32 on the CPU.
    pub precision: Precision,
    /// Window attention on a GPU; the default is the fastest kernel for the device and
    /// precision (the CPU runs its own kernel whatever the choice).
    pub attention: Attention,
    /// Lanes per GPU (each its own CUDA stream and copy of the weights).
    pub streams: usize,
    /// Let fp32 matrix products on a GPU use TF32 tensor cores (about 1e-3 relative error).
    pub tf32: bool,
    /// Tile side in input pixels (0: the whole image); `None` chooses from free memory.
    pub tile: Option<usize>,
    /// Input pixels shared by neighbouring tiles; smaller than a fixed tile.
    pub overlap: usize,
    /// Tiles per forward pass; `None` chooses with the tile.
    pub batch: Option<usize>,
    /// How overlapping tiles are merged.
    pub blend: BlendMode,
    /// Test-time self-ensemble over the eight flips and transpositions (8x the time).
    pub tta: bool,
    /// The size of the results: the model's scale, or the model's output resampled
    /// (Lanczos3) to another factor or to a width and/or height.
    pub size: OutputSize,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            device: DeviceChoice::Auto,
            precision: Precision::Auto,
            attention: Attention::default(),
            streams: 1,
            tf32: false,
            tile: None,
            overlap: 32,
            batch: None,
            blend: BlendMode::default(),
            tta: false,
            size: OutputSize::Model,
        }
    }
}

/// A fixed tile no larger than the overlap: no tile would have a core of its own.
#[derive(Debug, thiserror::Error)]
#[error("tile {tile} must be larger than the overlap {overlap}")]
struct TileNotLargerThanOverlap {
    tile: usize,
    overlap: usize,
}

/// A model loaded on its device(s), ready for any number of images.
pub struct Upscaler {
    lanes: Lanes,
    settings: TileSettings,
    size: OutputSize,
    warnings: Vec<String>,
}

impl Upscaler {
    /// Opens `model` (a `.pth` or `.safetensors` file; `None` for the embedded default model)
    /// as `opts` asks. This is the one place a model, its device(s) and the tile plan are put
    /// together; the command-line tool comes through here too. What it falls back from (a GPU
    /// that did not answer, a precision the device lacks) is logged as a warning (the `log`
    /// crate) and kept in [`Upscaler::warnings`].
    pub fn open(model: Option<&Path>, opts: &Options) -> Result<Self, Error> {
        if let Some(t) = opts.tile {
            if t != 0 && t <= opts.overlap {
                return Err(Error::new(
                    ErrorKind::InvalidOption,
                    TileNotLargerThanOverlap {
                        tile: t,
                        overlap: opts.overlap,
                    },
                ));
            }
        }
        let mut warnings = Vec::new();
        let mut warn = |w: String| {
            log::warn!("{w}");
            warnings.push(w);
        };
        let device = open_device(&opts.device, &mut warn)?;
        let dtype = choose_dtype(opts.precision, &device, &mut warn);
        if opts.streams > 1 && device.is_cpu() {
            warn(format!(
                "{} streams apply to CUDA devices; the CPU runs one",
                opts.streams
            ));
        }
        if opts.tf32 {
            if device.is_cpu() {
                warn("TF32 applies to CUDA devices; the CPU computes in fp32".into());
            }
            candle_core::cuda::set_gemm_reduced_precision_f32(true);
        }
        let ck = read_checkpoint(model)?;
        let lanes = Lanes::open(
            ck,
            device,
            (dtype, opts.attention),
            &opts.device,
            opts.streams.max(1),
            &mut warn,
        )?;
        let settings = TileSettings {
            choice: opts.tile.map_or(TileChoice::Auto, TileChoice::Fixed),
            overlap: opts.overlap,
            batch: opts.batch,
            blend: opts.blend,
            tta: opts.tta,
        };
        Ok(Self {
            lanes,
            settings,
            size: opts.size,
            warnings,
        })
    }

    /// The engine(s) the model runs on (bench drives them directly).
    pub(crate) fn lanes(&self) -> &Lanes {
        &self.lanes
    }

    /// The tile settings [`Upscaler::open`] made of its options.
    pub(crate) fn settings(&self) -> &TileSettings {
        &self.settings
    }

    /// How many lanes every image is spread over: one on the CPU, `streams` per GPU.
    pub fn lane_count(&self) -> usize {
        self.lanes.count()
    }

    /// The model's upscaling factor.
    pub fn scale(&self) -> usize {
        self.lanes.primary().scale()
    }

    /// What opening the model fell back from (a GPU that did not answer, a precision the
    /// device lacks).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// `img` upscaled by [`Upscaler::scale`] (then resampled to [`Options::size`]): gray
    /// stays gray, alpha is kept (upscaled through the network too), and the sample depth
    /// follows the input (16-bit in, 16-bit out).
    pub fn upscale(&self, img: &DynamicImage) -> Result<DynamicImage, Error> {
        let dec = crate::io::decode::to_planar(img.clone(), Format::Png);
        let (rgb, alpha) = self.upscale_planes(&dec)?;
        let mut opts = EncodeOptions::new(Format::Png);
        opts.bit_depth = dec.bit_depth;
        Ok(crate::io::encode::to_image(
            &rgb,
            alpha.as_ref(),
            dec.gray,
            &opts,
        )?)
    }

    /// Upscales the image file `input` into `output` as the command-line tool does one file:
    /// PNG, JPEG, WebP or TIFF by `output`'s extension; 16-bit samples kept where the format
    /// holds them; the ICC profile and EXIF carried over where the format can hold them (the
    /// EXIF orientation reset, since the pixels are written upright); the output written to a
    /// temporary name beside it and renamed, so it is never left half-written. Transparency a
    /// JPEG cannot hold is dropped with a logged warning.
    pub fn upscale_file(&self, input: &Path, output: &Path) -> Result<(), Error> {
        let format = Format::from_path(output).ok_or_else(|| IoError::BadOutput {
            path: output.to_path_buf(),
            detail: "the extension names no image format (png, jpg, webp, tif)".into(),
        })?;
        let dec = crate::io::decode(input)?;
        let (rgb, alpha) = self.upscale_planes(&dec)?;
        if alpha.is_some() && !format.supports_alpha() {
            log::warn!(
                "{}: {format} has no alpha channel; transparency is dropped",
                output.display()
            );
        }
        let mut opts = EncodeOptions::new(format);
        opts.bit_depth = format.default_bit_depth(dec.bit_depth);
        let left_out =
            crate::io::encode(output, &rgb, alpha.as_ref(), dec.gray, &dec.metadata, &opts)?;
        for piece in left_out {
            log::debug!("{}: {piece}", output.display());
        }
        Ok(())
    }

    /// A decoded image (see [`crate::io::decode`]) upscaled and resampled to
    /// [`Options::size`], with how it was tiled and each lane's share of the work. Alpha goes
    /// through the network on its own, so its edges stay as sharp as the colour's.
    pub fn upscale_image(&self, dec: &Decoded) -> Result<Upscaled, Error> {
        self.upscale_deferred_as(dec, false)?.finish()
    }

    /// [`Upscaler::upscale_image`] up to the last step: on a GPU the output canvases stay
    /// in device memory until [`Pending::finish`], which another thread may call while this
    /// one starts the next image, so the device does not wait for the host's blending and
    /// resampling. Each pending image holds its canvases until it is finished.
    pub fn upscale_deferred(&self, dec: &Decoded) -> Result<Pending, Error> {
        self.upscale_deferred_as(dec, true)
    }

    fn upscale_deferred_as(&self, dec: &Decoded, defer: bool) -> Result<Pending, Error> {
        let image = self.lanes.upscale_pending(dec, &self.settings, defer)?;
        let (width, height) = self.size.dims(dec.rgb.width, dec.rgb.height, self.scale());
        Ok(Pending {
            image,
            width,
            height,
        })
    }

    /// The colour and alpha planes of `dec` upscaled and resampled to [`Options::size`].
    fn upscale_planes(&self, dec: &Decoded) -> Result<(Planar, Option<Planar>), Error> {
        let up = self.upscale_image(dec)?;
        Ok((up.rgb, up.alpha))
    }
}

/// An image [`Upscaler::upscale_deferred`] has run through the network but not finished.
pub struct Pending {
    image: crate::engine::image::Pending,
    /// The final size.
    width: usize,
    height: usize,
}

impl Pending {
    /// The upscaled image: canvases still on a device come back, are normalised by their
    /// blend weights and resampled to the final size.
    pub fn finish(self) -> Result<Upscaled, Error> {
        let mut up = self.image.finish()?;
        (up.rgb, up.alpha) = crate::size::resize(up.rgb, up.alpha.take(), self.width, self.height)?;
        Ok(up)
    }
}

/// Whether `Precision::Bf16` on the CPU computes in bf16 on this machine (AMX, or
/// AVX512-BF16 on an AMD core, where it outruns f32); elsewhere it runs in fp32 with a
/// warning. Fixed for a machine: the same command gives the same pixels on every run.
pub fn cpu_computes_bf16() -> bool {
    crate::ops::cpu::bf16::supported()
}
