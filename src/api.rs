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

use crate::switches::Switches;
use std::path::Path;

use image::DynamicImage;

use crate::engine::image::Upscaled;
use crate::engine::lanes::Lanes;
use crate::engine::{choose_dtype, open_device, read_checkpoint, DeviceChoice, Precision};
use crate::error::{Error, ErrorKind};
use crate::fit::{OutputNeed, Writing};
use crate::io::{BandLayout, Decoded, EncodeOptions, Format, IoError, Metadata};
use crate::ops::attention::Attention;
use crate::planar::Planar;
use crate::size::OutputSize;
use crate::tile::auto::{TileChoice, TileSettings};
use crate::tile::{BlendMode, LaneStats, TileStats};

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
    /// The tuning switches the model was opened with (checked by then).
    switches: Switches,
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
            // Opening the model checked them: a refused value stopped it.
            switches: crate::switches::current(),
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

    /// Whether a folder run should finish each image off the model's thread
    /// ([`Upscaler::upscale_deferred`]), so the device is not idle while the host brings the
    /// canvas back, blends, resamples and encodes: on a GPU unless `UPSCALE_DEFER_FINISH=0`
    /// (`1` asks for it on the CPU too). On an H200 a folder of 12 photos ran at 12.0
    /// images/s deferred and 10.2 not; each deferred image holds its canvas in device memory
    /// until it is finished.
    pub fn defers_finish(&self) -> bool {
        let on_gpu = self.lanes.devices().iter().any(|d| d.is_cuda());
        self.switches.defer_finish.unwrap_or(on_gpu)
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
        if dec.alpha.is_some() && !format.supports_alpha() {
            log::warn!(
                "{}: {format} has no alpha channel; transparency is dropped",
                output.display()
            );
        }
        let mut opts = EncodeOptions::new(format);
        opts.bit_depth = format.default_bit_depth(dec.bit_depth);
        let left_out = match self.writing(&dec, &opts, true)? {
            Writing::Bands => {
                self.upscale_bands(&dec, output, &opts, &dec.metadata)?
                    .left_out
            }
            Writing::Whole => {
                let (rgb, alpha) = self.upscale_planes(&dec)?;
                crate::io::encode(output, &rgb, alpha.as_ref(), dec.gray, &dec.metadata, &opts)?
            }
        };
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

    /// How `dec`'s output would be written with `opts` (to a file when `to_file`, else to a
    /// stream such as standard output), decided before the model runs: in bands of rows as
    /// tiles finish, or whole. An output its format cannot hold, or one that must be written
    /// whole and needs more memory than the system has available, is refused with what would
    /// write it. `UPSCALE_STREAM` (`always`, `never`) overrides the choice where both can.
    pub fn writing(
        &self,
        dec: &Decoded,
        opts: &EncodeOptions,
        to_file: bool,
    ) -> Result<Writing, Error> {
        let need = self.output_need(dec, opts, to_file);
        let stream = self.switches.stream;
        Ok(crate::fit::plan(
            &need,
            crate::tile::auto::available_ram(),
            stream,
        )?)
    }

    /// What [`crate::fit::plan`] needs to know of `dec`'s output.
    fn output_need(&self, dec: &Decoded, opts: &EncodeOptions, to_file: bool) -> OutputNeed {
        let s = self.scale() as u64;
        let (in_w, in_h) = (dec.rgb.width as u64, dec.rgb.height as u64);
        let (w, h) = self.size.dims(dec.rgb.width, dec.rgb.height, self.scale());
        let (w, h) = (w as u64, h as u64);
        let model_px = in_w * in_h * s * s;
        let resized = (w, h) != (in_w * s, in_h * s);
        let varying_alpha = dec.alpha.as_ref().is_some_and(|a| constant(a).is_none());
        // The probe's pixel layout is the file's (gray, alpha, depth); an option the format
        // does not take fails the encoder later with its own message.
        let probe_alpha = dec.alpha.as_ref().map(|_| Planar::new(1, 1, 1, vec![1.0]));
        let (samples, sample_bytes) = match crate::io::encode::to_image(
            &Planar::zeros(3, 1, 1),
            probe_alpha.as_ref(),
            dec.gray,
            opts,
        ) {
            Ok(img) => {
                let c = img.color();
                (
                    u64::from(c.channel_count()),
                    u64::from(c.bytes_per_pixel() / c.channel_count()),
                )
            }
            Err(_) => (3, 1),
        };
        // The canvas (a sum per sample, a weight per pixel, in f32) normalised in place; the
        // alpha canvas as large again; the ensemble's sum and one transformed copy; the
        // resampled result; the encoded samples and the encoder's copy of them.
        let whole_bytes = model_px * (20 + if varying_alpha { 20 } else { 0 })
            + if self.settings.tta { model_px * 24 } else { 0 }
            + if resized { w * h * 16 } else { 0 }
            + 2 * w * h * samples * sample_bytes;
        let no_bands = if !to_file {
            Some("to standard output")
        } else if self.settings.tta {
            Some("with --tta")
        } else if resized {
            Some("when it is resampled to another size than the model's")
        } else if varying_alpha {
            Some("with a transparency that varies")
        } else {
            None
        };
        OutputNeed {
            format: opts.format,
            width: w,
            height: h,
            samples,
            sample_bytes,
            whole_bytes,
            no_bands,
        }
    }

    /// Upscales `dec` into the file `output` in bands of rows as the tiles finish, so memory
    /// holds the model, a batch of tiles and a band of rows rather than the image: the same
    /// samples as [`Upscaler::upscale_file`] writes whole, for a PNG or TIFF file at the
    /// model's scale, with no ensemble and alpha that is absent or constant (see
    /// [`Upscaler::writing`]). Written through a temporary, renamed only when complete.
    pub fn upscale_bands(
        &self,
        dec: &Decoded,
        output: &Path,
        opts: &EncodeOptions,
        meta: &Metadata,
    ) -> Result<Banded, Error> {
        let need = self.output_need(dec, opts, true);
        if let Some(why) = need.no_bands {
            return Err(IoError::Encode {
                path: output.to_path_buf(),
                format: opts.format,
                detail: format!("cannot be written in bands {why}"),
            }
            .into());
        }
        let layout = BandLayout {
            width: need.width as usize,
            height: need.height as usize,
            gray: dec.gray,
            alpha: dec.alpha.as_ref().and_then(constant),
        };
        let mut done = None;
        let left_out = crate::io::encode_bands(output, layout, meta, opts, |sink| {
            let ran = self.lanes.run_banded(&dec.rgb, &self.settings, |band| {
                sink(band).map_err(Error::from)
            })?;
            done = Some(ran);
            Ok::<(), Error>(())
        })?;
        let (stats, lanes) = done.expect("set when the bands were written");
        Ok(Banded {
            width: layout.width,
            height: layout.height,
            stats,
            lanes,
            left_out,
        })
    }

    /// The colour and alpha planes of `dec` upscaled and resampled to [`Options::size`].
    fn upscale_planes(&self, dec: &Decoded) -> Result<(Planar, Option<Planar>), Error> {
        let up = self.upscale_image(dec)?;
        Ok((up.rgb, up.alpha))
    }
}

/// The value of every sample of `alpha`, when they are all the same (the engine fills such
/// an alpha rather than running it through the network).
fn constant(alpha: &Planar) -> Option<f32> {
    let first = alpha.data.first().copied().unwrap_or(1.0);
    alpha.data.iter().all(|&v| v == first).then_some(first)
}

/// An image [`Upscaler::upscale_bands`] wrote.
#[derive(Clone, Debug)]
pub struct Banded {
    /// The output's width.
    pub width: usize,
    /// The output's height.
    pub height: usize,
    /// How it was tiled.
    pub stats: TileStats,
    /// The work of the one lane that ran it.
    pub lanes: Vec<LaneStats>,
    /// What of the metadata the format could not hold.
    pub left_out: Vec<String>,
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
