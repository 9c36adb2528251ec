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
/// the limits stop a kernel that loops forever instead. On a 2-core machine the address
/// sanitizer's run takes about 20 s of one core and the thread sanitizer's two halves about
/// 75 s each: the limits leave room for a CPU three times slower with other builds beside it.
const LIMIT: Duration = Duration::from_secs(300);
const LIMIT_TSAN: Duration = Duration::from_secs(600);

/// The widest heads' cases (tests/kernels/harness.cpp's `--quick` leaves them out).
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
        1,
    );
}

/// A missing `__syncthreads` (a thread reading shared memory another writes without a barrier
/// between them) gives right answers on most runs, on the CPU and the GPU alike; the thread
/// sanitizer sees the emulator's barriers and reports it every time, whatever order the
/// emulator runs the threads in. A cp.async destination counts as written when the copy is
/// issued (the earliest the GPU may land it), so refilling a buffer others may still be
/// reading is a race too. Every case runs, split between two processes (the harness's
/// `--shard`), so that it takes both cores of a small machine beside the address check.
#[test]
fn cuda_kernels_share_memory_without_data_races() {
    run_check("tsan", &["-O1", "-fsanitize=thread"], LIMIT_TSAN, 2);
}

/// Builds tests/kernels/harness.cpp with `flags`, runs it as `shards` processes at once (each
/// every `shards`-th case) within `limit` and checks that every kernel family passed.
fn run_check(tag: &str, flags: &[&str], limit: Duration, shards: usize) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/kernels");
    let exe =
        std::env::temp_dir().join(format!("upscale-kernel-check-{tag}-{}", std::process::id()));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let build = Command::new(&cxx)
        .args(["-std=c++20", "-g", "-ffp-contract=off"])
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

    // The first report ends a run, so its output stays small.
    let mut children: Vec<_> = (0..shards)
        .map(|i| {
            Command::new(&exe)
                .args(["--shard", &format!("{i}/{shards}")])
                .env("TSAN_OPTIONS", "halt_on_error=1")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("starting the kernel check")
        })
        .collect();
    let start = Instant::now();
    while children.iter_mut().any(|c| {
        c.try_wait()
            .expect("waiting for the kernel check")
            .is_none()
    }) {
        if start.elapsed() > limit {
            for c in &mut children {
                let _ = c.kill();
            }
            let _ = std::fs::remove_file(&exe);
            panic!("the kernel check ({tag}) ran past {limit:?}: a kernel loops forever");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = std::fs::remove_file(&exe);
    let mut stdout = String::new();
    for child in children {
        let out = child.wait_with_output().expect("kernel check output");
        let text = String::from_utf8_lossy(&out.stdout);
        eprintln!("{text}");
        assert!(
            out.status.success(),
            "kernel check ({tag}) failed:\n{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout.push_str(&text);
    }
    // Every attention variant family (window and overlapping), the blend kernel and each
    // row-wise kernel reported, none skipped, the widest heads included.
    for name in WIDE.iter().copied().chain([
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
        "gather_norm_bf16 wide",
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
