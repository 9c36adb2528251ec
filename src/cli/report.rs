//! `upscale report LOG...`: the `--json` output of many runs (the shards of a job array, a
//! run and its re-runs) combined into one account of what was done, skipped and failed, and
//! which shards never finished.
//!
//! Lines that are not a `--json` record are passed over and counted, because schedulers
//! often write a task's stderr into the same file as its stdout.

use std::collections::{BTreeMap, BTreeSet};
use std::io::BufRead;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use serde_json::{json, Value};

/// The combined account of a set of logs.
#[derive(Debug, Default, PartialEq)]
pub struct Report {
    pub logs: usize,
    /// Logs with no summary line: their run was killed, or is still going.
    pub unfinished: Vec<String>,
    /// Per input: how many runs wrote it.
    pub done: BTreeMap<String, usize>,
    /// Inputs no run wrote, with the last error one gave and the log it is in.
    pub failed: BTreeMap<String, (String, String)>,
    /// Outputs that runs found there already, summed over the summaries.
    pub skipped: u64,
    /// From the summaries of sharded runs: N, and the shards K with a finished run.
    pub shards: BTreeMap<usize, BTreeSet<usize>>,
    /// Lines that were not `--json` records.
    pub other_lines: usize,
}

impl Report {
    /// Adds one log's lines; `name` names it in the report.
    pub fn add(&mut self, name: &str, lines: impl BufRead) -> std::io::Result<()> {
        self.logs += 1;
        let mut finished = false;
        let mut errors = Vec::new();
        for line in lines.lines() {
            let line = line?;
            let Ok(Value::Object(record)) = serde_json::from_str::<Value>(&line) else {
                self.other_lines += 1;
                continue;
            };
            if record.get("summary") == Some(&Value::Bool(true)) {
                finished = true;
                self.skipped += record.get("skipped").and_then(Value::as_u64).unwrap_or(0);
                if let Some((k, n)) = record
                    .get("shard")
                    .and_then(Value::as_str)
                    .and_then(|s| s.split_once('/'))
                    .and_then(|(k, n)| Some((k.parse().ok()?, n.parse().ok()?)))
                {
                    self.shards.entry(n).or_default().insert(k);
                }
                continue;
            }
            let (Some(input), Some(status)) = (
                record.get("input").and_then(Value::as_str),
                record.get("status").and_then(Value::as_str),
            ) else {
                self.other_lines += 1;
                continue;
            };
            match status {
                "ok" => *self.done.entry(input.to_string()).or_default() += 1,
                _ => {
                    let error = record
                        .get("error")
                        .and_then(Value::as_str)
                        .unwrap_or(status);
                    errors.push((input.to_string(), error.to_string()));
                }
            }
        }
        for (input, error) in errors {
            self.failed.insert(input, (error, name.to_string()));
        }
        if !finished {
            self.unfinished.push(name.to_string());
        }
        Ok(())
    }

    /// Drops failures that another run made good.
    fn settle(&mut self) {
        let done = &self.done;
        self.failed.retain(|input, _| !done.contains_key(input));
    }

    /// The shards of each N that no finished run covered.
    pub fn missing_shards(&self) -> BTreeMap<usize, Vec<usize>> {
        self.shards
            .iter()
            .map(|(&n, seen)| (n, (0..n).filter(|k| !seen.contains(k)).collect::<Vec<_>>()))
            .filter(|(_, missing)| !missing.is_empty())
            .collect()
    }

    /// Whether anything is left to do: a failed image, a shard with no finished run, or (when
    /// the runs were not sharded) a log that did not finish.
    pub fn incomplete(&self) -> bool {
        !self.failed.is_empty()
            || !self.missing_shards().is_empty()
            || (self.shards.is_empty() && !self.unfinished.is_empty())
    }

    pub fn redone(&self) -> Vec<&str> {
        self.done
            .iter()
            .filter(|(_, &n)| n > 1)
            .map(|(input, _)| input.as_str())
            .collect()
    }

    pub fn to_json(&self) -> Value {
        let failed: Vec<Value> = self
            .failed
            .iter()
            .map(|(input, (error, log))| json!({"input": input, "error": error, "log": log}))
            .collect();
        let missing: BTreeMap<String, Vec<usize>> = self
            .missing_shards()
            .into_iter()
            .map(|(n, ks)| (n.to_string(), ks))
            .collect();
        json!({
            "logs": self.logs,
            "unfinished_logs": self.unfinished,
            "done": self.done.len(),
            "redone": self.redone(),
            "skipped": self.skipped,
            "failed": failed,
            "missing_shards": missing,
            "other_lines": self.other_lines,
            "complete": !self.incomplete(),
        })
    }

    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let finished = self.logs - self.unfinished.len();
        out.push_str(&format!(
            "{} logs, {finished} with a summary line",
            self.logs
        ));
        if !self.unfinished.is_empty() {
            out.push_str(&format!(
                "; without one (killed, or still running): {}",
                self.unfinished.join(", ")
            ));
        }
        out.push('\n');
        out.push_str(&format!(
            "{} images done, {} skipped (there already), {} failed\n",
            self.done.len(),
            self.skipped,
            self.failed.len()
        ));
        for (input, (error, log)) in &self.failed {
            // The tool's messages start with the path already.
            let what = match error.contains(input.as_str()) {
                true => error.clone(),
                false => format!("{input}: {error}"),
            };
            out.push_str(&format!("failed: {what} ({log})\n"));
        }
        let redone = self.redone();
        if !redone.is_empty() {
            out.push_str(&format!(
                "written by more than one run: {}\n",
                redone.join(", ")
            ));
        }
        for (n, ks) in self.missing_shards() {
            let list = ks
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(",");
            out.push_str(&format!(
                "shards of {n} without a finished run: {list} (re-run them, e.g. sbatch --array={list} with --shard auto/{n})\n"
            ));
        }
        if self.other_lines > 0 {
            out.push_str(&format!(
                "{} lines that are not --json records passed over\n",
                self.other_lines
            ));
        }
        out
    }
}

/// Reads the logs (`-` for standard input) and prints the report; exit code 1 when
/// something is left to do.
pub fn run(logs: &[PathBuf], as_json: bool) -> Result<ExitCode> {
    let mut report = Report::default();
    for path in logs {
        let name = path.display().to_string();
        if name == "-" {
            report.add(&name, std::io::stdin().lock())
        } else {
            let file = std::fs::File::open(path).with_context(|| name.clone())?;
            report.add(&name, std::io::BufReader::new(file))
        }
        .with_context(|| format!("reading {name}"))?;
    }
    report.settle();
    if as_json {
        println!("{}", report.to_json());
    } else {
        print!("{}", report.to_text());
    }
    Ok(if report.incomplete() {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(logs: &[(&str, &str)]) -> Report {
        let mut r = Report::default();
        for (name, text) in logs {
            r.add(name, text.as_bytes()).unwrap();
        }
        r.settle();
        r
    }

    const SHARD0: &str = r#"{"input":"in/a.png","output":"out/a.png","status":"ok"}
{"input":"in/c.png","output":"out/c.png","status":"error","error":"in/c.png: not an image"}
{"summary":true,"done":1,"failed":1,"skipped":0,"shard":"0/2"}
"#;

    #[test]
    fn shards_combine_and_failures_are_named() {
        let shard1 = "{\"input\":\"in/b.png\",\"status\":\"ok\"}\nloading the model\n\
                      {\"summary\":true,\"done\":1,\"failed\":0,\"skipped\":2,\"shard\":\"1/2\"}\n";
        let r = report(&[("s0.out", SHARD0), ("s1.out", shard1)]);
        assert_eq!(r.done.len(), 2);
        assert_eq!(r.skipped, 2);
        assert_eq!(r.other_lines, 1);
        assert_eq!(
            r.failed.get("in/c.png"),
            Some(&("in/c.png: not an image".to_string(), "s0.out".to_string()))
        );
        assert!(r.missing_shards().is_empty());
        assert!(r.incomplete(), "a failed image is left to do");
        let text = r.to_text();
        assert!(
            text.contains("2 images done, 2 skipped (there already), 1 failed"),
            "{text}"
        );
        assert!(
            text.contains("failed: in/c.png: not an image (s0.out)"),
            "{text}"
        );
        let j = r.to_json();
        assert_eq!(j["failed"][0]["input"], "in/c.png");
        assert_eq!(j["complete"], false);
    }

    #[test]
    fn a_killed_shard_is_missing_until_a_rerun_finishes() {
        let killed = "{\"input\":\"in/b.png\",\"status\":\"ok\"}\n";
        let r = report(&[("s0.out", SHARD0), ("s1.out", killed)]);
        assert_eq!(r.unfinished, ["s1.out"]);
        assert_eq!(r.missing_shards(), BTreeMap::from([(2, vec![1])]));
        assert!(r
            .to_text()
            .contains("shards of 2 without a finished run: 1"));
        assert_eq!(r.to_json()["missing_shards"]["2"], json!([1]));

        // The re-run skips b and finishes; a failure made good by another run is no failure.
        let rerun = "{\"input\":\"in/d.png\",\"status\":\"ok\"}\n\
                     {\"input\":\"in/c.png\",\"status\":\"ok\"}\n\
                     {\"summary\":true,\"done\":2,\"failed\":0,\"skipped\":1,\"shard\":\"1/2\"}\n";
        let r = report(&[("s0.out", SHARD0), ("s1.out", killed), ("s1b.out", rerun)]);
        assert!(r.missing_shards().is_empty());
        assert!(r.failed.is_empty());
        assert!(!r.incomplete());
        assert!(r.redone().is_empty());
        assert_eq!(r.to_json()["complete"], true);
    }

    #[test]
    fn work_done_twice_is_shown() {
        let again =
            "{\"input\":\"in/a.png\",\"status\":\"ok\"}\n{\"summary\":true,\"skipped\":0}\n";
        let r = report(&[("s0.out", SHARD0), ("again.out", again)]);
        assert_eq!(r.redone(), ["in/a.png"]);
        assert!(r.to_text().contains("more than one run: in/a.png"));
    }

    #[test]
    fn unsharded_runs_need_a_summary() {
        let r = report(&[("run.out", "{\"input\":\"x.png\",\"status\":\"ok\"}\n")]);
        assert!(r.shards.is_empty());
        assert!(r.incomplete());
        let r = report(&[("run.out", "{\"summary\":true,\"skipped\":3}\n")]);
        assert!(!r.incomplete());
        assert_eq!(r.skipped, 3);
    }
}
