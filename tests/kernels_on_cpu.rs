//! The CUDA kernels of kernels/, checked on any machine: tests/kernels/harness.cpp compiles
//! them with the host C++ compiler through tests/kernels/emulator.h (each CUDA thread a fiber
//! on one OS thread; warp shuffles and tensor-core mma exchanged through per-warp barriers,
//! the mma with PTX's documented fragment layout) and compares every variant with a
//! double-precision reference written from the model's definition. This is what CI, which has
//! no GPU, knows about the kernels' indexing, masks and softmax; the GPU tests check the same
//! kernels on the device. Needs a C++20 compiler with `_Float16` and the address and thread
//! sanitizers (GCC 12+, Clang 15+): `$CXX`, else `c++`.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The emulator reports a barrier some thread never reaches at once (a deadlock of the block);
/// the limits stop a kernel that loops forever instead. The address-sanitizer check takes
/// about 20 s on one core of a 2-core machine and the thread sanitizer's about 80 s on the
/// other: the limits leave room for a CPU three times slower with other builds beside it.
const LIMIT: Duration = Duration::from_secs(300);
const LIMIT_TSAN: Duration = Duration::from_secs(600);

/// The cases only the full set runs (tests/kernels/harness.cpp, `--quick` leaves them out).
const WIDE: [&str; 5] = [
    "window_attention_f32_d128",
    "window_attention_mma_bf16_d128",
    "window_attention_mma_f16_d80",
    "overlap_attention_f32_d128",
    "overlap_attention_mma_f16_d112",
];

#[test]
fn cuda_kernels_match_double_precision_references_on_the_cpu() {
    // A GPU faults on a misaligned 32-bit load, or on a read past a buffer or past the
    // launch's shared memory, where a CPU mostly reads on: the sanitizers stop the check at
    // each (tests/kernels/emulator.h poisons the shared memory no launch asked for).
    run_check(
        "asan",
        &[
            "-O2",
            "-fsanitize=address,alignment",
            "-fno-sanitize-recover=alignment",
        ],
        LIMIT,
        false,
    );
}

/// A missing `__syncthreads` (a thread reading shared memory another writes without a barrier
/// between them) gives right answers on most runs, on the CPU and the GPU alike; the thread
/// sanitizer sees the emulator's barriers and reports it every time, whatever order the
/// emulator runs the threads in. A cp.async destination counts as written when the copy is
/// issued (the earliest the GPU may land it), so refilling a buffer others may still be
/// reading is a race too. It runs the harness's quick set: every kernel and template once,
/// without the widest heads' second shapes, whose barriers are the same code with longer
/// loops (half the run's time).
#[test]
fn cuda_kernels_share_memory_without_data_races() {
    run_check("tsan", &["-O1", "-fsanitize=thread"], LIMIT_TSAN, true);
}

/// Builds tests/kernels/harness.cpp with `flags`, runs it (its quick set if `quick`) within
/// `limit` and checks that every kernel family passed.
fn run_check(tag: &str, flags: &[&str], limit: Duration, quick: bool) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/kernels");
    let exe =
        std::env::temp_dir().join(format!("upscale-kernel-check-{tag}-{}", std::process::id()));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let build = Command::new(&cxx)
        .args(["-std=c++20", "-g", "-pthread", "-ffp-contract=off"])
        .args(flags)
        .arg(format!("-I{}", dir.join("include").display()))
        .arg("-include")
        .arg(dir.join("emulator.h"))
        .arg(dir.join("harness.cpp"))
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("running {cxx}: {e} (set CXX to a C++20 compiler)"));
    assert!(
        build.status.success(),
        "{cxx} could not build the kernel check ({tag}):\n{}",
        String::from_utf8_lossy(&build.stderr)
    );

    // The first report ends the run, so its output stays small.
    let mut child = Command::new(&exe)
        .args(quick.then_some("--quick"))
        .env("TSAN_OPTIONS", "halt_on_error=1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the kernel check");
    let start = Instant::now();
    while child
        .try_wait()
        .expect("waiting for the kernel check")
        .is_none()
    {
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = std::fs::remove_file(&exe);
            panic!("the kernel check ({tag}) ran past {limit:?}: a kernel loops forever");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("kernel check output");
    let _ = std::fs::remove_file(&exe);
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}");
    assert!(
        out.status.success(),
        "kernel check ({tag}) failed:\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Every attention variant family (window and overlapping), the blend kernel and each
    // row-wise kernel reported, none skipped; the widest heads unless this is the quick set.
    let wide = if quick { &[][..] } else { &WIDE[..] };
    for name in wide.iter().copied().chain([
        "window_attention_f32_d32",
        "window_attention_bf16_d32",
        "window_attention_f16_d64",
        "window_attention_mma_f16_d48",
        "window_attention_mma_bf16_d16",
        "window_attention_mma_bf16_d64",
        "overlap_attention_f32_d32",
        "overlap_attention_bf16_d32",
        "overlap_attention_f16_d64",
        "overlap_attention_mma_bf16_d32",
        "overlap_attention_mma_f16_d32",
        "overlap_attention_mma_f16_d16",
        "overlap_attention_mma_bf16_d16",
        "overlap_attention_mma_f16_d64",
        "blend_add_f32",
        "bias_act_bf16",
        "cat_bias_act_f16",
        "gather_norm_f32",
        "add_gather_norm_bf16",
        "add_scaled_gather_norm_f32",
        "add_scaled_gather_norm_bf16",
        "add_scaled_gather_norm_f16",
        "gather_norm_regs_f32",
        "add_gather_norm_regs_bf16",
        "add_scaled_gather_norm_regs_f16",
        "gather_norm_regs_bf16 wide",
        "patches3x3_f32",
        "patches3x3_bf16",
        "patches3x3_f16",
        "conv3x3_narrow_f32",
        "conv3x3_narrow_bf16",
        "conv3x3_narrow_f16",
    ]) {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with("ok") && l.contains(name)),
            "no passing case for {name}:\n{stdout}"
        );
    }
}
