//! Folder runs through the binary: nested trees with broken and foreign files, resuming, a
//! run killed halfway, and sharding across processes.

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime};

use common::*;
use image::GenericImageView;

fn mtime(path: &Path) -> SystemTime {
    fs::metadata(path).unwrap().modified().unwrap()
}

/// A tree with images at three depths, one broken PNG and a file that is no image at all.
fn nested_tree(root: &Path) {
    write_png(&root.join("a.png"), 20, 16);
    write_jpeg(&root.join("photo.jpg"), 16, 16);
    write_png(&root.join("sub/b.png"), 12, 12);
    write_jpeg(&root.join("sub/deeper/c.jpeg"), 10, 14);
    write_png(&root.join("sub/broken.png"), 16, 16);
    let bytes = fs::read(root.join("sub/broken.png")).unwrap();
    fs::write(root.join("sub/broken.png"), &bytes[..bytes.len() / 2]).unwrap();
    fs::write(root.join("notes.txt"), b"not a picture").unwrap();
}

#[test]
fn nested_folder_with_a_broken_file_then_resume() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    nested_tree(&dir.join("in"));
    let want: BTreeSet<String> = ["a.png", "photo.jpg", "sub/b.png", "sub/deeper/c.jpeg"]
        .map(String::from)
        .into();

    let run = upscale(dir)
        .args(["in", "-r", "-o", "out", "--json"])
        .output()
        .unwrap();
    assert_no_panic(&run);
    assert_eq!(run.status.code(), Some(1), "{}", stderr(&run));
    assert_eq!(files_under(&dir.join("out")), want);
    for (name, size) in [
        ("a.png", (40, 32)),
        ("photo.jpg", (32, 32)),
        ("sub/b.png", (24, 24)),
        ("sub/deeper/c.jpeg", (20, 28)),
    ] {
        let img = image::open(dir.join("out").join(name)).unwrap();
        assert_eq!(img.dimensions(), size, "{name}");
    }
    let errors = error_lines(&run);
    assert_eq!(errors.len(), 1, "{}", stderr(&run));
    assert!(
        errors[0].contains(&format!("sub{}broken.png", std::path::MAIN_SEPARATOR)),
        "{}",
        errors[0]
    );
    assert!(!stderr(&run).contains("notes.txt"), "{}", stderr(&run));

    let lines = json_lines(&run);
    let failed: Vec<&serde_json::Value> = lines.iter().filter(|l| l["status"] == "error").collect();
    assert_eq!(failed.len(), 1);
    assert!(failed[0]["input"].as_str().unwrap().ends_with("broken.png"));
    let s = summary(&lines);
    assert_eq!(
        (s["done"].as_u64(), s["failed"].as_u64()),
        (Some(4), Some(1))
    );
    assert!(temporaries_under(dir).is_empty());

    // The re-run leaves the finished files alone and fails on the broken one again.
    let before: Vec<SystemTime> = want
        .iter()
        .map(|f| mtime(&dir.join("out").join(f)))
        .collect();
    let run = upscale(dir)
        .args(["in", "-r", "-o", "out", "--json"])
        .output()
        .unwrap();
    assert_no_panic(&run);
    assert_eq!(run.status.code(), Some(1), "{}", stderr(&run));
    let lines = json_lines(&run);
    let s = summary(&lines);
    assert_eq!(
        (
            s["done"].as_u64(),
            s["skipped"].as_u64(),
            s["failed"].as_u64()
        ),
        (Some(0), Some(4), Some(1))
    );
    let after: Vec<SystemTime> = want
        .iter()
        .map(|f| mtime(&dir.join("out").join(f)))
        .collect();
    assert_eq!(before, after, "a finished output was rewritten");
    assert_eq!(error_lines(&run).len(), 1, "{}", stderr(&run));
    assert!(temporaries_under(dir).is_empty());
}

#[test]
fn folder_defaults_flat_and_sibling() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    nested_tree(&dir.join("in"));
    fs::remove_file(dir.join("in/sub/broken.png")).unwrap();

    // Without -r only the top level is taken; without -o results go to a sibling folder.
    upscale(dir).arg("in").assert().success();
    assert_eq!(
        files_under(&dir.join("in_x2")),
        ["a.png", "photo.jpg"].map(String::from).into()
    );
    // With -r the sub-folders follow; the finished a.png is skipped, and --format changes
    // only the extension.
    upscale(dir)
        .args(["in", "-r", "--format", "png"])
        .assert()
        .success();
    assert_eq!(
        files_under(&dir.join("in_x2")),
        [
            "a.png",
            "photo.jpg",
            "photo.png",
            "sub/b.png",
            "sub/deeper/c.png"
        ]
        .map(String::from)
        .into()
    );
}

#[test]
fn killed_run_leaves_only_complete_files_and_resumes() {
    const COUNT: usize = 12;
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    for i in 0..COUNT {
        write_png(&dir.join(format!("in/img{i:02}.png")), 48, 48);
    }
    let out = dir.join("out");

    let mut child = std::process::Command::new(bin())
        .current_dir(dir)
        .arg("-m")
        .arg(golden(FAST_MODEL))
        .args(["--device", "cpu", "in", "-o", "out", "-q"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let killed_pid = child.id();
    // Kill as soon as the first result lands, while the rest are still in flight.
    let deadline = Instant::now() + Duration::from_secs(120);
    let finished_early = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        let done = files_under(&out).iter().any(|f| !f.contains("upscale-tmp"));
        if done || Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    child.kill().unwrap_or_default();
    child.wait().unwrap();
    assert!(
        finished_early.is_none(),
        "the run ended before it could be killed: {finished_early:?}"
    );

    let mut complete = 0;
    for name in files_under(&out) {
        if name.contains("upscale-tmp") {
            continue;
        }
        let img = image::open(out.join(&name))
            .unwrap_or_else(|e| panic!("{name} is incomplete after the kill: {e}"));
        assert_eq!(img.dimensions(), (96, 96), "{name}");
        complete += 1;
    }
    assert!(complete < COUNT, "nothing was left to do after the kill");

    // A partial write of a dead process, as a kill during encoding leaves it.
    let stale = format!(".img{:02}.png.upscale-tmp-{killed_pid}-999", COUNT - 1);
    fs::write(out.join(&stale), b"\x89PNG\r\n\x1a\npartial").unwrap();
    let stale_before = temporaries_under(&out);

    let rerun = std::process::Command::new(bin())
        .current_dir(dir)
        .arg("-m")
        .arg(golden(FAST_MODEL))
        .args(["--device", "cpu", "in", "-o", "out", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let rerun_pid = rerun.id();
    let run = rerun.wait_with_output().unwrap();
    assert_success(&run);
    let lines = json_lines(&run);
    let s = summary(&lines);
    assert_eq!(s["skipped"].as_u64(), Some(complete as u64));
    assert_eq!(s["done"].as_u64(), Some((COUNT - complete) as u64));

    for i in 0..COUNT {
        let img = image::open(out.join(format!("img{i:02}.png"))).unwrap();
        assert_eq!(img.dimensions(), (96, 96));
    }
    let left = temporaries_under(&out);
    assert!(
        !left
            .iter()
            .any(|t| t.contains(&format!("upscale-tmp-{rerun_pid}-"))),
        "the re-run left its own temporaries: {left:?}"
    );
    // The re-run neither reads the dead process's temporaries nor trips over them; whatever
    // it does with them, nothing new may appear.
    assert!(left.iter().all(|t| stale_before.contains(t)), "{left:?}");
    if !left.is_empty() {
        eprintln!("note: temporaries of the killed run still present: {left:?}");
    }
}

#[test]
fn shards_are_disjoint_and_cover_the_folder() {
    const COUNT: usize = 7;
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    for i in 0..COUNT {
        write_png(&dir.join(format!("in/p{i}.png")), 8 + i as u32, 8);
    }
    let mut seen: Vec<String> = Vec::new();
    for k in 0..3 {
        let run = upscale(dir)
            .args(["in", "-o", "out", "--json", "--shard", &format!("{k}/3")])
            .output()
            .unwrap();
        assert_success(&run);
        let lines = json_lines(&run);
        let mine: Vec<String> = lines
            .iter()
            .filter(|l| l["status"] == "ok")
            .map(|l| l["input"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(summary(&lines)["done"].as_u64(), Some(mine.len() as u64));
        assert!(
            mine.len() == 2 || mine.len() == 3,
            "shard {k}/3 took {mine:?}"
        );
        seen.extend(mine);
    }
    let unique: BTreeSet<&String> = seen.iter().collect();
    assert_eq!(unique.len(), seen.len(), "shards overlap: {seen:?}");
    let all: BTreeSet<String> = (0..COUNT)
        .map(|i| {
            Path::new("in")
                .join(format!("p{i}.png"))
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    assert_eq!(unique.into_iter().cloned().collect::<BTreeSet<_>>(), all);
    assert_eq!(files_under(&dir.join("out")).len(), COUNT);
}

#[test]
fn stale_temporaries_are_removed_fresh_ones_kept() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    std::fs::create_dir_all(root.join("in")).unwrap();
    std::fs::create_dir_all(root.join("out")).unwrap();
    rgb_image(12, 10).save(root.join("in/a.png")).unwrap();
    // Left by a killed run an hour ago, one a live writer in another process may own, and a
    // stale one of an output this run does not write (not this run's to judge).
    let stale = root.join("out/.a.png.upscale-tmp-999999-1");
    let fresh = root.join("out/.a.png.upscale-tmp-999999-2");
    let foreign = root.join("out/.b.png.upscale-tmp-999999-3");
    for p in [&stale, &fresh, &foreign] {
        std::fs::write(p, b"partial").unwrap();
    }
    let hour_ago = SystemTime::now() - std::time::Duration::from_secs(3600);
    for p in [&stale, &foreign] {
        std::fs::File::options()
            .write(true)
            .open(p)
            .unwrap()
            .set_modified(hour_ago)
            .unwrap();
    }
    upscale(root)
        .args(["in", "-o", "out", "-q"])
        .assert()
        .success();
    assert!(!stale.exists(), "a stale temporary must be cleaned up");
    assert!(
        fresh.exists(),
        "a fresh temporary may belong to a live writer"
    );
    assert!(
        foreign.exists(),
        "another output's temporary is not this run's"
    );
    assert!(root.join("out/a.png").exists());
}

/// Every variable `--shard auto` reads: cleared on a child before the test sets its own, so
/// that a test run inside a job array sees only the test's.
const SCHEDULER_VARS: [&str; 11] = [
    "SLURM_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_ARRAY_TASK_MIN",
    "SLURM_ARRAY_TASK_MAX",
    "SLURM_ARRAY_TASK_COUNT",
    "JOB_COMPLETION_INDEX",
    "AWS_BATCH_JOB_ID",
    "AWS_BATCH_JOB_ARRAY_INDEX",
    "AWS_BATCH_JOB_ARRAY_SIZE",
    "BATCH_TASK_INDEX",
    "BATCH_TASK_COUNT",
];

fn with_scheduler(cmd: &mut assert_cmd::Command, vars: &[(&str, &str)]) {
    for v in SCHEDULER_VARS.iter().chain(&["UPSCALE_SHARD_COUNT"]) {
        cmd.env_remove(v);
    }
    for (k, v) in vars {
        cmd.env(k, v);
    }
}

/// The inputs a `--json` run wrote.
fn written(run: &std::process::Output) -> BTreeSet<String> {
    json_lines(run)
        .iter()
        .filter(|l| l["status"] == "ok")
        .map(|l| l["input"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn shard_auto_takes_each_schedulers_index() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    for i in 0..5 {
        write_png(&dir.join(format!("in/p{i}.png")), 8 + i, 8);
    }
    // Shard 1 of 2 of the sorted list: p1 and p3.
    let want: BTreeSet<String> = [1, 3]
        .map(|i| {
            Path::new("in")
                .join(format!("p{i}.png"))
                .to_string_lossy()
                .into_owned()
        })
        .into();
    // What -v says, the variables set, the flag.
    type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a [&'a str]);
    let cases: [Case; 5] = [
        (
            "Slurm (SLURM_ARRAY_TASK_ID=4 of array 3-4 (2 tasks)): shard 1/2",
            &[
                ("SLURM_JOB_ID", "9"),
                ("SLURM_ARRAY_TASK_ID", "4"),
                ("SLURM_ARRAY_TASK_MIN", "3"),
                ("SLURM_ARRAY_TASK_MAX", "4"),
                ("SLURM_ARRAY_TASK_COUNT", "2"),
            ],
            &["--shard", "auto"],
        ),
        (
            "Kubernetes Indexed Job (JOB_COMPLETION_INDEX=1): shard 1/2",
            &[("JOB_COMPLETION_INDEX", "1"), ("UPSCALE_SHARD_COUNT", "2")],
            &["--shard", "auto"],
        ),
        (
            "Kubernetes Indexed Job (JOB_COMPLETION_INDEX=1): shard 1/2",
            &[("JOB_COMPLETION_INDEX", "1")],
            &["--shard", "auto/2"],
        ),
        (
            "AWS Batch (AWS_BATCH_JOB_ARRAY_INDEX=1, AWS_BATCH_JOB_ARRAY_SIZE=2): shard 1/2",
            &[
                ("AWS_BATCH_JOB_ID", "j:1"),
                ("AWS_BATCH_JOB_ARRAY_INDEX", "1"),
                ("AWS_BATCH_JOB_ARRAY_SIZE", "2"),
            ],
            &["--shard", "auto"],
        ),
        (
            "Google Cloud Batch (BATCH_TASK_INDEX=1, BATCH_TASK_COUNT=2): shard 1/2",
            &[("BATCH_TASK_INDEX", "1"), ("BATCH_TASK_COUNT", "2")],
            &["--shard", "auto"],
        ),
    ];
    for (i, (said, vars, flags)) in cases.into_iter().enumerate() {
        let mut cmd = upscale(dir);
        cmd.args(["in", "-o", &format!("out{i}"), "--json", "-v"])
            .args(flags);
        with_scheduler(&mut cmd, vars);
        let run = cmd.output().unwrap();
        assert_success(&run);
        assert!(
            stderr(&run).contains(&format!("--shard auto: {said}")),
            "{}",
            stderr(&run)
        );
        assert_eq!(written(&run), want, "{said}");
        assert_eq!(summary(&json_lines(&run))["shard"], "1/2");
    }
}

#[test]
fn shard_auto_refusals_come_before_the_model_loads() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    write_png(&dir.join("in/a.png"), 8, 8);
    let cases: [(&[(&str, &str)], &str); 4] = [
        (&[], "no job array found"),
        (&[("SLURM_JOB_ID", "5")], "not an array job"),
        (
            &[
                ("SLURM_ARRAY_TASK_ID", "4"),
                ("SLURM_ARRAY_TASK_MIN", "0"),
                ("SLURM_ARRAY_TASK_MAX", "12"),
                ("SLURM_ARRAY_TASK_COUNT", "4"),
            ],
            "stepped or sparse",
        ),
        (&[("JOB_COMPLETION_INDEX", "0")], "UPSCALE_SHARD_COUNT"),
    ];
    for (vars, needle) in cases {
        // A model that does not exist: the shard is refused first, so it is never opened.
        let mut cmd = bare(dir);
        cmd.args(["-m", "missing.pth", "in", "-o", "out", "--shard", "auto"]);
        with_scheduler(&mut cmd, vars);
        let run = cmd.output().unwrap();
        assert_no_panic(&run);
        assert_eq!(run.status.code(), Some(2), "{}", stderr(&run));
        let errors = error_lines(&run);
        assert_eq!(errors.len(), 1, "{}", stderr(&run));
        assert!(errors[0].contains(needle), "{vars:?}: {}", errors[0]);
        assert!(!errors[0].contains("missing.pth"), "{}", errors[0]);
        assert!(!dir.join("out").exists());
    }
}

/// Two shards' `--json` logs (one with a broken file), one killed before its summary, and
/// `upscale report` over them: the failure named, the unfinished shard found.
#[test]
fn report_combines_shard_logs() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    for i in 0..4 {
        write_png(&dir.join(format!("in/p{i}.png")), 8 + i, 8);
    }
    fs::write(dir.join("in/p2.png"), b"\x89PNG\r\n\x1a\nbroken").unwrap();
    let mut logs = Vec::new();
    for k in 0..2 {
        let mut cmd = upscale(dir);
        cmd.args([
            "in",
            "-o",
            "out",
            "--json",
            "--shard",
            &format!("auto/{}", 2),
        ]);
        with_scheduler(&mut cmd, &[("JOB_COMPLETION_INDEX", &k.to_string())]);
        let run = cmd.output().unwrap();
        assert_no_panic(&run);
        let log = dir.join(format!("shard{k}.jsonl"));
        fs::write(&log, &run.stdout).unwrap();
        logs.push(log);
    }
    // Shard 0 held the broken p2.png.
    let report = |logs: &[std::path::PathBuf], json: bool| {
        let mut cmd = bare(dir);
        cmd.arg("report").args(logs);
        if json {
            cmd.arg("--json");
        }
        cmd.output().unwrap()
    };
    let run = report(&logs, false);
    assert_no_panic(&run);
    assert_eq!(run.status.code(), Some(1), "a failed image is left to do");
    let text = stdout(&run);
    assert!(
        text.contains("3 images done, 0 skipped (there already), 1 failed"),
        "{text}"
    );
    let broken = Path::new("in")
        .join("p2.png")
        .to_string_lossy()
        .into_owned();
    assert!(
        text.lines()
            .any(|l| l.starts_with(&format!("failed: {broken}: "))),
        "{text}"
    );

    // Shard 1's log cut before its summary, as a killed task leaves it: shard 1 is missing.
    let cut: String = fs::read_to_string(&logs[1])
        .unwrap()
        .lines()
        .filter(|l| !l.contains("\"summary\""))
        .map(|l| format!("{l}\n"))
        .collect();
    fs::write(&logs[1], cut).unwrap();
    let run = report(&logs, true);
    let j: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(j["missing_shards"]["2"], serde_json::json!([1]), "{j}");
    assert_eq!(j["done"], 3);
    assert_eq!(j["failed"][0]["input"], broken.as_str());
    assert_eq!(j["complete"], false);

    let run = report(&[dir.join("no-such.jsonl")], false);
    assert_eq!(run.status.code(), Some(2));
    assert!(
        error_lines(&run)[0].contains("no-such.jsonl"),
        "{}",
        stderr(&run)
    );
}
