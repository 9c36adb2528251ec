//! Many images through one loaded model: each task is read, upscaled and finished, with
//! the reading and the finishing on worker threads so the model never waits for the disk.
//!
//! The runner knows nothing of files. What a task is and what its stages do is a
//! [`Stages`]: [`FileStages`] decodes an input file (or standard input), upscales it and
//! encodes the result to its output for `upscale INPUT...`; `upscale eval` reads a
//! ground-truth pair and measures the result instead of writing it. A stage that fails or
//! panics fails its task alone, and every task gets exactly one outcome.

use std::io::Write;
use std::path::Path;
use std::sync::mpsc::sync_channel;
use std::sync::Mutex;
use std::time::Instant;

use upscale::io::{self, DecodeLimits, Decoded, EncodeOptions};
use upscale::Writing;
use upscale::{Banded, LaneStats, Pending, Upscaled, Upscaler};

use super::naming::{is_dash, Job, STDIN_NAME};

/// Tasks waiting between stages: enough to hide a slow file, few enough to bound memory.
const QUEUE_DEPTH: usize = 2;

/// What happens to each task. `read` and `finish` run on worker threads, `upscale` on the
/// caller's (the one that owns the model).
pub(crate) trait Stages: Sync {
    type Task: Send + Clone;
    type Read: Send;
    /// What the model hands the finisher.
    type Up: Send;
    type Done: Send;
    /// Names the task in messages.
    fn name<'t>(&self, task: &'t Self::Task) -> &'t Path;
    fn read(&self, task: &Self::Task) -> Result<Self::Read, String>;
    fn upscale(&self, task: &Self::Task, read: &Self::Read) -> Result<Self::Up, String>;
    fn finish(
        &self,
        task: &Self::Task,
        read: Self::Read,
        up: Self::Up,
    ) -> Result<Self::Done, String>;
    /// How many upscaled tasks may wait for the finisher.
    fn finish_queue(&self) -> usize {
        QUEUE_DEPTH
    }
}

/// A task and how it ended.
pub(crate) type Outcome<S> = (<S as Stages>::Task, Result<<S as Stages>::Done, String>);

/// Runs one stage of one task, turning a panic (a bug, in our code or a library's) into an
/// error for that task alone: the others go on, and the caller counts it as failed instead
/// of the outcome going missing.
fn guarded<T>(what: &Path, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(format!("{}: internal error: {msg}", what.display()))
        }
    }
}

fn upscale_one<S: Stages>(st: &S, task: &S::Task, read: &S::Read) -> Result<S::Up, String> {
    let name = st.name(task);
    guarded(name, || st.upscale(task, read)).map_err(|e| format!("{}: {e}", name.display()))
}

/// Every stage on this thread, one task after another. `report` sees each outcome as it
/// happens.
pub(crate) fn run_inline<S: Stages>(
    st: &S,
    tasks: Vec<S::Task>,
    report: &mut dyn FnMut(&Outcome<S>),
) -> Vec<Outcome<S>> {
    tasks
        .into_iter()
        .map(|task| {
            let name = st.name(&task);
            let result = guarded(name, || st.read(&task)).and_then(|read| {
                let up = upscale_one(st, &task, &read)?;
                guarded(name, || st.finish(&task, read, up))
            });
            let o = (task, result);
            report(&o);
            o
        })
        .collect()
}

/// Reader thread -> model (this thread) -> `finishers` finisher threads (at least one), with
/// bounded queues between. Several finishers encode several images at once, which keeps a
/// fast GPU from waiting on one encoder. Outcomes come back in task order; a task lost with
/// a thread that died outside the guarded stages is reported as failed.
pub(crate) fn run_threaded<S: Stages>(
    st: &S,
    tasks: Vec<S::Task>,
    finishers: usize,
    report: &(dyn Fn(&Outcome<S>) + Sync),
) -> Vec<Outcome<S>> {
    let count = tasks.len();
    let all = tasks.clone();
    type Slot<S> = Mutex<Vec<Option<Outcome<S>>>>;
    let slots: Slot<S> = Mutex::new((0..count).map(|_| None).collect());
    let done = |i: usize, o: Outcome<S>| {
        report(&o);
        slots.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(o);
    };
    let (up_tx, up_rx) = sync_channel::<(usize, S::Task, S::Read, S::Up)>(st.finish_queue());
    // The finishers share one receiver.
    let up_rx = Mutex::new(up_rx);
    std::thread::scope(|scope| {
        // Dropped when the model is done (the end of this closure), which ends the finishers.
        let up_tx = up_tx;
        let (read_tx, read_rx) = sync_channel(QUEUE_DEPTH);
        scope.spawn(move || {
            for (i, task) in tasks.into_iter().enumerate() {
                let read = guarded(st.name(&task), || st.read(&task));
                if read_tx.send((i, task, read)).is_err() {
                    break;
                }
            }
        });
        let done = &done;
        let up_rx = &up_rx;
        for _ in 0..finishers.max(1) {
            scope.spawn(move || loop {
                // The lock is held only while waiting for the next task, not while finishing.
                let next = up_rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                let Ok((i, task, read, up)) = next else { break };
                let result = guarded(st.name(&task), || st.finish(&task, read, up));
                done(i, (task, result));
            });
        }
        for (i, task, read) in read_rx {
            let up = read.and_then(|read| {
                let up = upscale_one(st, &task, &read)?;
                Ok((read, up))
            });
            match up {
                Ok((read, up)) => {
                    if up_tx.send((i, task, read, up)).is_err() {
                        break;
                    }
                }
                Err(e) => done(i, (task, Err(e))),
            }
        }
    });
    let slots = slots.into_inner().unwrap_or_else(|p| p.into_inner());
    slots
        .into_iter()
        .zip(all)
        .map(|(slot, task)| {
            slot.unwrap_or_else(|| {
                let msg = format!(
                    "{}: lost by a failed worker thread",
                    st.name(&task).display()
                );
                let o = (task, Err(msg));
                report(&o);
                o
            })
        })
        .collect()
}

/// How outputs are encoded.
pub(crate) struct EncodeChoice {
    /// `None`: follow the input (8 or 16 bits) where the format can.
    pub bit_depth: Option<u8>,
    pub quality: u8,
    /// No ICC profile or EXIF in the outputs.
    pub strip: bool,
}

/// What one image came to.
#[derive(Clone, Debug)]
pub(crate) struct Written {
    pub in_size: (usize, usize),
    pub out_size: (usize, usize),
    pub seconds: f64,
    pub tiles: usize,
    pub lanes: Vec<LaneStats>,
}

/// Writes one upscaled image in place of [`FileStages::write`] (tests use it to plant
/// failures).
pub(crate) type WriteFn<'a> =
    &'a (dyn Fn(&FileStages, &Job, &Decoded, &Upscaled) -> Result<(), String> + Sync);

/// `upscale INPUT...`: decode each job's input, upscale (and resample to the requested
/// size), encode to its output through a temporary file.
pub(crate) struct FileStages<'a> {
    /// The model, its devices, tiling and output size.
    pub up: &'a Upscaler,
    pub encode: EncodeChoice,
    /// Standard input's bytes, when the input is `-` (taken by the first read).
    pub stdin: Mutex<Option<Vec<u8>>>,
    /// Warnings about an output (transparency it cannot hold).
    pub warn: &'a (dyn Fn(String) + Sync),
    /// Details for `-v` (metadata an output could not take).
    pub detail: &'a (dyn Fn(String) + Sync),
    pub writer: Option<WriteFn<'a>>,
    /// [`upscale::Upscaler::defers_finish`], asked once for the run.
    pub defer_finish: bool,
}

/// When each job started, so a job's time covers all three stages.
pub(crate) type Timed = (Instant, Decoded);

/// What the model thread hands the finisher: the image, or (with `defer_finish`) its
/// canvases, which the finisher brings back and blends while the model starts the next.
pub(crate) enum Up {
    Done(Upscaled),
    Pending(Pending),
    /// Already written, in bands as it was computed.
    Banded(Banded),
}

impl Stages for FileStages<'_> {
    type Task = Job;
    type Read = Timed;
    type Up = Up;
    type Done = Written;

    fn name<'t>(&self, job: &'t Job) -> &'t Path {
        &job.input.path
    }

    fn read(&self, job: &Job) -> Result<Timed, String> {
        let t = Instant::now();
        let path = &job.input.path;
        if !is_dash(path) {
            return io::decode(path).map(|d| (t, d)).map_err(|e| e.to_string());
        }
        let bytes = self
            .stdin
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()
            .unwrap_or_default();
        io::decode_bytes(Path::new(STDIN_NAME), &bytes, &DecodeLimits::default())
            .map(|d| (t, d))
            .map_err(|e| e.to_string())
    }

    fn upscale(&self, job: &Job, (_, dec): &Timed) -> Result<Up, String> {
        let opts = self.encode_options(job, dec.bit_depth);
        let to_file = !is_dash(&job.output);
        let writing = self
            .up
            .writing(dec, &opts, to_file)
            .map_err(|e| e.to_string())?;
        if writing == Writing::Bands {
            // Written while it is computed, on this thread: the output never exists whole.
            return self
                .up
                .upscale_bands(dec, &job.output, &opts, self.metadata(dec))
                .map(Up::Banded)
                .map_err(|e| e.to_string());
        }
        if self.defer_finish {
            return self
                .up
                .upscale_deferred(dec)
                .map(Up::Pending)
                .map_err(|e| format!("{e:#}"));
        }
        self.up
            .upscale_image(dec)
            .map(Up::Done)
            .map_err(|e| format!("{e:#}"))
    }

    /// A deferred image holds its output canvas in device memory until it is finished: the
    /// model hands each one over only when the finisher is ready for it, so at most two
    /// are held (the one finishing and the one just computed).
    fn finish_queue(&self) -> usize {
        if self.defer_finish {
            0
        } else {
            QUEUE_DEPTH
        }
    }

    fn finish(&self, job: &Job, (t, dec): Timed, up: Up) -> Result<Written, String> {
        let up = match up {
            Up::Done(up) => up,
            Up::Pending(pending) => pending.finish().map_err(|e| format!("{e:#}"))?,
            Up::Banded(b) => {
                for note in b.left_out {
                    (self.detail)(format!("{}: {note}", job.output.display()));
                }
                return Ok(Written {
                    in_size: (dec.rgb.width, dec.rgb.height),
                    out_size: (b.width, b.height),
                    seconds: t.elapsed().as_secs_f64(),
                    tiles: b.stats.tiles,
                    lanes: b.lanes,
                });
            }
        };
        match self.writer {
            Some(writer) => writer(self, job, &dec, &up)?,
            None => self.write(job, &dec, &up)?,
        }
        Ok(Written {
            in_size: (dec.rgb.width, dec.rgb.height),
            out_size: (up.rgb.width, up.rgb.height),
            seconds: t.elapsed().as_secs_f64(),
            tiles: up.stats.tiles,
            lanes: up.lanes,
        })
    }
}

impl FileStages<'_> {
    fn encode_options(&self, job: &Job, dec_depth: u8) -> EncodeOptions {
        let mut opts = EncodeOptions::new(job.format);
        opts.bit_depth = self
            .encode
            .bit_depth
            .unwrap_or_else(|| job.format.default_bit_depth(dec_depth));
        opts.quality = self.encode.quality;
        opts
    }

    /// The metadata to write: the input's, unless stripped.
    fn metadata<'d>(&self, dec: &'d Decoded) -> &'d io::Metadata {
        static NONE: io::Metadata = io::Metadata {
            icc: None,
            exif: None,
            exif_dropped: false,
        };
        if self.encode.strip {
            &NONE
        } else {
            &dec.metadata
        }
    }

    /// Encodes `up` to the job's output (a file through a temporary, or standard output).
    pub(crate) fn write(&self, job: &Job, dec: &Decoded, up: &Upscaled) -> Result<(), String> {
        let opts = self.encode_options(job, dec.bit_depth);
        let to_stdout = is_dash(&job.output);
        let name = match to_stdout {
            true => "standard output".to_string(),
            false => job.output.display().to_string(),
        };
        if up.alpha.is_some() && !job.format.supports_alpha() {
            (self.warn)(format!(
                "{name}: {} has no alpha channel; transparency is dropped",
                job.format
            ));
        }
        if opts.bit_depth == 16 && !job.format.supports_16bit() {
            return Err(format!(
                "{name}: {} cannot hold 16-bit samples (use --bit-depth 8 or --format png|tiff)",
                job.format
            ));
        }
        let meta = self.metadata(dec);
        let left_out = if to_stdout {
            let (bytes, left_out) = io::encode_to_vec(
                Path::new("-"),
                &up.rgb,
                up.alpha.as_ref(),
                dec.gray,
                meta,
                &opts,
            )
            .map_err(|e| e.to_string())?;
            let mut out = std::io::stdout().lock();
            out.write_all(&bytes)
                .and_then(|()| out.flush())
                .map_err(|e| format!("{name}: {e}"))?;
            left_out
        } else {
            io::encode(
                &job.output,
                &up.rgb,
                up.alpha.as_ref(),
                dec.gray,
                meta,
                &opts,
            )
            .map_err(|e| e.to_string())?
        };
        for note in left_out {
            (self.detail)(format!("{name}: {note}"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::cli::naming::{plan_outputs, NamingOptions};
    use crate::cli::walk::walk;
    use upscale::{BlendMode, DeviceChoice, Options, OutputSize, Precision};

    /// The 12x10 RGB model of the golden fixtures, one lane on the CPU in fp32, tiles of
    /// `tile` overlapping by `overlap`, results of `size`.
    fn cpu_upscaler(tile: usize, overlap: usize, size: OutputSize) -> Upscaler {
        let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/x2_w8_b2.safetensors");
        let opts = Options {
            device: DeviceChoice::Cpu,
            precision: Precision::Fp32,
            tile: Some(tile),
            overlap,
            batch: None,
            blend: BlendMode::Hann,
            tta: false,
            size,
            ..Options::default()
        };
        Upscaler::open(Some(&model), &opts).unwrap()
    }

    /// The main command's stages, quiet, encoding as the defaults do.
    fn file_stages<'a>(
        up: &'a Upscaler,
        writer: Option<WriteFn<'a>>,
        defer_finish: bool,
    ) -> FileStages<'a> {
        FileStages {
            up,
            encode: EncodeChoice {
                bit_depth: None,
                quality: 90,
                strip: false,
            },
            stdin: Mutex::new(None),
            warn: &|_| {},
            detail: &|_| {},
            writer,
            defer_finish,
        }
    }

    /// A job for each of `inputs`, written into `out` with the `x2` tag.
    fn jobs_into(inputs: &[PathBuf], out: &Path) -> Vec<Job> {
        let naming = NamingOptions {
            output: Some(out.to_path_buf()),
            tag: "x2".into(),
            format: None,
            overwrite: true,
        };
        plan_outputs(&walk(inputs, false).unwrap(), &naming).unwrap()
    }

    /// Finishing on the finisher thread (`Upscaler::defers_finish`) writes the same bytes as
    /// finishing on the model thread: tiled colour, an alpha channel run through the
    /// network, and a resampled output size.
    #[test]
    fn deferred_finishing_writes_the_same_files() {
        let dir = tempfile::tempdir().unwrap();
        let rgb = dir.path().join("rgb.png");
        image::RgbImage::from_fn(13, 11, |x, y| image::Rgb([x as u8 * 19, y as u8 * 23, 90]))
            .save(&rgb)
            .unwrap();
        let rgba = dir.path().join("rgba.png");
        image::RgbaImage::from_fn(12, 9, |x, y| {
            image::Rgba([200, x as u8 * 20, y as u8 * 25, (x * y * 7) as u8])
        })
        .save(&rgba)
        .unwrap();
        let inputs = [rgb, rgba];
        for size in [OutputSize::Model, OutputSize::Width(30)] {
            let up = cpu_upscaler(8, 2, size);
            let mut written = Vec::new();
            for defer_finish in [false, true] {
                let stages = file_stages(&up, None, defer_finish);
                let out = dir.path().join(format!("out-{defer_finish}-{size:?}"));
                let jobs = jobs_into(&inputs, &out);
                let outcomes = run_threaded(&stages, jobs, 2, &|_| {});
                let files: Vec<Vec<u8>> = outcomes
                    .iter()
                    .map(|(job, r)| {
                        assert!(r.is_ok(), "{r:?}");
                        std::fs::read(&job.output).unwrap()
                    })
                    .collect();
                written.push(files);
            }
            assert_eq!(written[0].len(), 2);
            assert!(
                written[0] == written[1],
                "{size:?}: deferred output differs"
            );
        }
    }

    /// Three images through both runners with a writer that panics on the second: that
    /// image fails with the panic's message, the others are written, and every image has
    /// exactly one outcome, reported once.
    #[test]
    fn a_panicking_writer_fails_its_image_only() {
        let dir = tempfile::tempdir().unwrap();
        let inputs: Vec<PathBuf> = (0..3)
            .map(|i| dir.path().join(format!("{i}.png")))
            .collect();
        for p in &inputs {
            image::RgbImage::from_fn(12, 10, |x, y| image::Rgb([x as u8 * 20, y as u8 * 20, 7]))
                .save(p)
                .unwrap();
        }
        let up = cpu_upscaler(0, 0, OutputSize::Model);
        let writer = |st: &FileStages, job: &Job, dec: &Decoded, up: &Upscaled| {
            if job.input.path.ends_with("1.png") {
                panic!("encoder bug");
            }
            st.write(job, dec, up)
        };
        let stages = file_stages(&up, Some(&writer), false);
        for threaded in [false, true] {
            let out = dir.path().join(format!("out-{threaded}"));
            let jobs = jobs_into(&inputs, &out);
            let reported = Mutex::new(0);
            let outcomes = if threaded {
                run_threaded(&stages, jobs, 3, &|_| *reported.lock().unwrap() += 1)
            } else {
                run_inline(&stages, jobs, &mut |_| *reported.lock().unwrap() += 1)
            };
            assert_eq!(outcomes.len(), 3, "threaded {threaded}");
            assert_eq!(*reported.lock().unwrap(), 3);
            for (job, result) in &outcomes {
                let second = job.input.path.ends_with("1.png");
                match result {
                    Err(e) => assert!(second && e.contains("encoder bug"), "{e}"),
                    Ok(_) => assert!(!second && job.output.exists()),
                }
            }
        }
    }
}
