//! Lane statistics as the command line reports them, on the CPU.

mod common;

#[test]
fn json_reports_the_work_of_each_lane() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    // RGBA: the alpha plane goes through the model too and counts as lane work.
    common::rgba_image(30, 20).save(dir.join("a.png")).unwrap();
    common::write_png(&dir.join("b.png"), 20, 20);
    let run = common::upscale(dir)
        .args(["a.png", "b.png", "--json", "-o", "out"])
        .args(["--tile", "16", "--tile_overlap", "4"])
        .output()
        .unwrap();
    common::assert_success(&run);
    let lines = common::json_lines(&run);
    let mut tiles = 0;
    for image in &lines[..2] {
        let lanes = image["lane_stats"].as_array().unwrap();
        assert_eq!(lanes.len(), 1, "{image}");
        assert_eq!(
            (&lanes[0]["lane"], &lanes[0]["device"]),
            (&0.into(), &"cpu".into())
        );
        assert!(lanes[0]["busy_seconds"].as_f64().unwrap() > 0.0);
        tiles += lanes[0]["tiles"].as_u64().unwrap();
    }
    let s = common::summary(&lines);
    assert_eq!(s["lanes"], 1);
    assert_eq!(s["lane_stats"][0]["tiles"].as_u64(), Some(tiles));
    // 3x2 tiles of 16 in the 30x20 image, twice with its alpha plane, and 2x2 in the other.
    assert_eq!(tiles, 16);
}

/// `upscale bench --json` of the small fixture model on the CPU with `args`, parsed.
fn bench_json(args: &[&str]) -> serde_json::Value {
    let d = tempfile::tempdir().unwrap();
    let run = common::bare(d.path())
        .arg("bench")
        .arg("-m")
        .arg(common::golden(common::FAST_MODEL))
        .args(["--device", "cpu", "--warmup", "0", "--json"])
        .args(args)
        .output()
        .unwrap();
    common::assert_success(&run);
    serde_json::from_str(common::stdout(&run).trim()).unwrap()
}

#[test]
fn bench_json_reports_lanes_and_memory() {
    let v = bench_json(&[
        "--size",
        "24x24",
        "--tile",
        "16",
        "--tile_overlap",
        "4",
        "--reps",
        "2",
    ]);
    assert_eq!(v["lanes"], 1);
    let lane = &v["lane_stats"][0];
    // Summed over the two timed runs.
    assert_eq!(
        lane["tiles"].as_u64(),
        Some(2 * v["tiles"].as_u64().unwrap())
    );
    assert!(v["peak_rss_bytes"].as_u64().unwrap() > 0);
    // Device memory is a GPU figure.
    assert!(v["peak_device_bytes"].is_null());
    assert_eq!(v["device_pools"], serde_json::json!([]));
    // An fp32 run names no bf16 kernel.
    assert_eq!(v["dtype"], "F32");
    assert!(v["cpu_bf16_kernel"].is_null(), "{v}");
}

/// The report names the instructions our kernels ran, held down by `UPSCALE_CPU_ISA`.
#[test]
fn bench_json_names_the_cpu_isa() {
    let widest = bench_json(&["--size", "16x16", "--reps", "1"]);
    let widest = widest["cpu_isa"].as_str().unwrap_or_default().to_string();
    assert!(
        ["avx512", "avx2", "scalar"].contains(&widest.as_str()),
        "{widest}"
    );
    for cap in ["scalar", "avx2"] {
        let d = tempfile::tempdir().unwrap();
        let run = common::bare(d.path())
            .arg("bench")
            .arg("-m")
            .arg(common::golden(common::FAST_MODEL))
            .args(["--device", "cpu", "--warmup", "0", "--json"])
            .args(["--size", "16x16", "--reps", "1"])
            .env("UPSCALE_CPU_ISA", cap)
            .output()
            .unwrap();
        common::assert_success(&run);
        let v: serde_json::Value = serde_json::from_str(common::stdout(&run).trim()).unwrap();
        // Never more than the CPU has: a cap above it reports what ran.
        let want = if cap == "avx2" && widest == "scalar" {
            "scalar"
        } else {
            cap
        };
        assert_eq!(v["cpu_isa"], want, "capped to {cap}: {v}");
    }
}

#[test]
fn bench_json_names_the_cpu_bf16_kernel() {
    let v = bench_json(&["--precision", "bf16", "--size", "16x16", "--reps", "1"]);
    if upscale::cpu_computes_bf16() {
        assert_eq!(v["dtype"], "BF16");
        let kernel = v["cpu_bf16_kernel"].as_str().unwrap_or_default();
        assert!(["amx", "avx512-bf16"].contains(&kernel), "{v}");
    } else {
        // The fp32 fallback (with its warning) runs no bf16 kernel.
        assert_eq!(v["dtype"], "F32");
        assert!(v["cpu_bf16_kernel"].is_null(), "{v}");
    }
}
