//! The project's own CUDA kernels (sources in kernels/). build.rs compiles each file to PTX
//! and packs it, with the SASS `ptxas` makes of it for the build's GPU, into a fatbin. A device
//! loads a file's fatbin once, on first use: the driver runs the SASS on the GPU the build
//! targets, and compiles the PTX for a newer one.

use std::sync::{Arc, Mutex, OnceLock, Weak};

use candle_core::cuda_backend::cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::{CudaDevice, Error, Result};

/// One kernels/*.cu file as the build made it.
pub struct Kernels {
    /// The source file's name, for messages.
    pub file: &'static str,
    pub ptx: &'static str,
    pub fatbin: &'static [u8],
}

/// Each kernels/*.cu file, named after it (`BLEND`), and the target `COMPUTE_CAP`.
pub mod kernels {
    use super::Kernels;
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}

/// Kernel `name` of `file` on `dev`'s context. `UPSCALE_CUDA_OFF=sass` loads the PTX instead of
/// the fatbin, so the driver compiles it as it would for a GPU newer than the build's.
pub fn function(dev: &CudaDevice, file: &Kernels, name: &str) -> Result<CudaFunction> {
    let sass = !crate::switches::current().cuda_off.sass;
    module(dev.cuda_stream().context(), file, sass)?
        .load_function(name)
        .map_err(|e| Error::Msg(format!("{}: kernel {name}: {e}", file.file)))
}

/// `file`'s module on `ctx`, loaded on first use. candle keeps a device's modules in the
/// device, where ours cannot go (it loads only PTX text), so they are kept here, per context
/// (every candle device has its own), and go once nothing but them holds their context.
fn module(ctx: &Arc<CudaContext>, file: &Kernels, sass: bool) -> Result<Arc<CudaModule>> {
    let mut entries = modules();
    if let Some(e) = entries
        .iter()
        .find(|e| Weak::as_ptr(&e.ctx) == Arc::as_ptr(ctx) && e.file == file.file && e.sass == sass)
    {
        return Ok(e.module.clone());
    }
    // Every new device loads here first, so stale entries go no later than the next device.
    let held_here = |ctx: &Weak<CudaContext>| entries.iter().filter(|e| e.ctx.ptr_eq(ctx)).count();
    let stale: Vec<Weak<CudaContext>> = entries
        .iter()
        .filter(|e| e.ctx.strong_count() <= held_here(&e.ctx))
        .map(|e| e.ctx.clone())
        .collect();
    entries.retain(|e| !stale.iter().any(|s| s.ptr_eq(&e.ctx)));
    let image = if sass {
        Ptx::from_binary(file.fatbin.to_vec())
    } else {
        Ptx::from_src(file.ptx)
    };
    let module = ctx.load_module(image).map_err(|e| {
        Error::Msg(if sass {
            format!(
                "{}: loading its SASS: {e} ({}=sass loads its PTX instead)",
                file.file,
                crate::switches::cuda_off::VAR
            )
        } else {
            format!("{}: loading its PTX: {e}", file.file)
        })
    })?;
    entries.push(Entry {
        ctx: Arc::downgrade(ctx),
        file: file.file,
        sass,
        module: module.clone(),
    });
    Ok(module)
}

struct Entry {
    // Weak, so that the context's address is not reused while the entry names it; the module
    // holds it strongly.
    ctx: Weak<CudaContext>,
    file: &'static str,
    sass: bool,
    module: Arc<CudaModule>,
}

fn modules() -> std::sync::MutexGuard<'static, Vec<Entry>> {
    static MODULES: OnceLock<Mutex<Vec<Entry>>> = OnceLock::new();
    MODULES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}
