//! The vector instructions our CPU kernels may use: the widest the CPU has, held down by
//! `UPSCALE_CPU_ISA` (`native`, `avx512`, `avx2`, `scalar`) so that the AVX2 and scalar paths
//! can be run, timed and tested on an AVX-512 machine. The `gemm` crate (candle's products,
//! and ours where the panel kernels are off) detects the CPU itself and is not held down.

use std::sync::OnceLock;

pub(crate) use crate::switches::CpuIsa;

/// The widest of our kernels this CPU runs: AVX-512F, else AVX2 with FMA, else scalar.
fn detected() -> CpuIsa {
    static ISA: OnceLock<CpuIsa> = OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return CpuIsa::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return CpuIsa::Avx2;
            }
        }
        CpuIsa::Scalar
    })
}

/// The instructions our kernels use: what the CPU has, capped by `UPSCALE_CPU_ISA` (read once
/// per process with the other switches; a value it does not know stops the model's load).
/// Never more than the
/// CPU has, so a kernel compiled for the result may run.
pub(crate) fn cpu_isa() -> CpuIsa {
    #[cfg(test)]
    if let Some(isa) = OVERRIDE.with(std::cell::Cell::get) {
        return isa.min(detected());
    }
    // The process's switch, not a thread's override of it: every kernel of a run, on every
    // thread, takes the same instructions. Kept once decided: the vector functions ask on
    // every call (a row at a time, in places), and reading the switches clones them.
    static CAPPED: std::sync::OnceLock<CpuIsa> = std::sync::OnceLock::new();
    *CAPPED.get_or_init(|| {
        let cap = crate::switches::from_env().unwrap_or_default().cpu_isa;
        cap.map_or(detected(), |cap| cap.min(detected()))
    })
}

#[cfg(test)]
thread_local! {
    static OVERRIDE: std::cell::Cell<Option<CpuIsa>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with our kernels held to `isa` (or what the CPU has, if less). The kernels' rayon
/// tasks run on other threads than the caller's, so `f` runs on a pool of its own whose
/// threads all carry the override; the rest of the process is left alone.
#[cfg(test)]
pub(crate) fn with_cpu_isa<R: Send>(isa: CpuIsa, f: impl FnOnce() -> R + Send) -> R {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(rayon::current_num_threads())
        .start_handler(move |_| OVERRIDE.with(|o| o.set(Some(isa))))
        .build()
        .expect("a thread pool for the ISA override");
    pool.install(f)
}

/// Every ISA this CPU runs, narrowest first: what tests run each kernel on.
#[cfg(test)]
pub(crate) fn supported() -> Vec<CpuIsa> {
    [CpuIsa::Scalar, CpuIsa::Avx2, CpuIsa::Avx512]
        .into_iter()
        .filter(|&isa| isa <= detected())
        .collect()
}

/// Runs `check` once with the kernels held to each ISA this CPU has, narrowest first, and
/// stops at the first failure, naming the ISA on stderr (a CPU without AVX2 or AVX-512 runs
/// fewer, and says so).
#[cfg(test)]
pub(crate) fn on_each_isa<E: Send>(check: impl Fn() -> Result<(), E> + Sync) -> Result<(), E> {
    let isas = supported();
    eprintln!("run on {isas:?}");
    for isa in isas {
        with_cpu_isa(isa, &check).inspect_err(|_| eprintln!("failed on {isa:?}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The override reaches the pool's threads and never lifts the ISA above the CPU's.
    #[test]
    fn the_override_holds_on_every_thread_of_its_pool() {
        use rayon::prelude::*;
        for isa in [CpuIsa::Scalar, CpuIsa::Avx2, CpuIsa::Avx512] {
            let seen: Vec<CpuIsa> =
                with_cpu_isa(isa, || (0..64).into_par_iter().map(|_| cpu_isa()).collect());
            assert!(
                seen.iter().all(|&s| s == isa.min(detected())),
                "{isa:?}: {seen:?}"
            );
        }
        assert_eq!(supported().last(), Some(&detected()));
    }
}
