//! `--shard auto`: the shard of this process, read from the job array that started it.
//!
//! Four schedulers are known, each by the variable that holds the task's index:
//!
//! | scheduler | index | count |
//! |---|---|---|
//! | Slurm | `SLURM_ARRAY_TASK_ID` | from `SLURM_ARRAY_TASK_MIN`, `_MAX`, `_COUNT` |
//! | Kubernetes Indexed Job | `JOB_COMPLETION_INDEX` | none: `auto/N` or `UPSCALE_SHARD_COUNT` |
//! | AWS Batch | `AWS_BATCH_JOB_ARRAY_INDEX` | `AWS_BATCH_JOB_ARRAY_SIZE` |
//! | Google Cloud Batch | `BATCH_TASK_INDEX` | `BATCH_TASK_COUNT` |
//!
//! Two ways to get N:
//! - `auto`: the scheduler's own count. For Slurm, K = ID - MIN and N = MAX - MIN + 1, which
//!   needs a contiguous array (`--array=0-15` or `1-16`, not `0-15:4` or `1,3,7`).
//! - `auto/N` (or `UPSCALE_SHARD_COUNT=N`): the index is taken as the shard number itself, so
//!   the array's task IDs must lie in 0..N, and any subset of them may run: `sbatch
//!   --array=2` re-runs shard 2 of N alone.
//!
//! Refused, each with one line: no scheduler's index (not under a job array); a Slurm or AWS
//! Batch job that is not an array; the variables of two schedulers at once (which one
//! started us cannot be told, and guessing could split the folder wrongly); a one-task Slurm
//! array whose ID is not 0 under plain `auto` (most likely a re-run of one task of a larger
//! array, which without N would take the whole list).

use super::shard::Shard;

/// The variable a job manifest sets to give N when the scheduler gives none (Kubernetes).
pub const COUNT_VAR: &str = "UPSCALE_SHARD_COUNT";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheduler {
    Slurm,
    Kubernetes,
    AwsBatch,
    GoogleBatch,
}

impl Scheduler {
    const ALL: [Scheduler; 4] = [
        Scheduler::Slurm,
        Scheduler::Kubernetes,
        Scheduler::AwsBatch,
        Scheduler::GoogleBatch,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Scheduler::Slurm => "Slurm",
            Scheduler::Kubernetes => "Kubernetes Indexed Job",
            Scheduler::AwsBatch => "AWS Batch",
            Scheduler::GoogleBatch => "Google Cloud Batch",
        }
    }

    fn index_var(self) -> &'static str {
        match self {
            Scheduler::Slurm => "SLURM_ARRAY_TASK_ID",
            Scheduler::Kubernetes => "JOB_COMPLETION_INDEX",
            Scheduler::AwsBatch => "AWS_BATCH_JOB_ARRAY_INDEX",
            Scheduler::GoogleBatch => "BATCH_TASK_INDEX",
        }
    }

    /// The variable that holds the array's size, where the scheduler sets one as is.
    fn count_var(self) -> Option<&'static str> {
        match self {
            Scheduler::AwsBatch => Some("AWS_BATCH_JOB_ARRAY_SIZE"),
            Scheduler::GoogleBatch => Some("BATCH_TASK_COUNT"),
            Scheduler::Slurm | Scheduler::Kubernetes => None,
        }
    }

    /// A variable every job of this scheduler has, array or not: it tells a job that is not
    /// an array from a process no scheduler started.
    fn job_var(self) -> Option<&'static str> {
        match self {
            Scheduler::Slurm => Some("SLURM_JOB_ID"),
            Scheduler::AwsBatch => Some("AWS_BATCH_JOB_ID"),
            Scheduler::Kubernetes | Scheduler::GoogleBatch => None,
        }
    }
}

/// The shard taken and where it came from, for `-v`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Detected {
    pub scheduler: Scheduler,
    pub shard: Shard,
    /// The variables read, e.g. `SLURM_ARRAY_TASK_ID=5 of array 0-7`.
    pub from: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AutoShardError {
    #[error("--shard auto: no job array found (none of SLURM_ARRAY_TASK_ID, JOB_COMPLETION_INDEX, AWS_BATCH_JOB_ARRAY_INDEX, BATCH_TASK_INDEX is set); run under a job array or give --shard K/N")]
    NoScheduler,
    #[error("--shard auto: this {scheduler} job is not an array job ({job_var} is set but not {index_var}); submit it as an array, or give --shard K/N")]
    NotAnArray {
        scheduler: &'static str,
        job_var: &'static str,
        index_var: &'static str,
    },
    #[error("--shard auto: the variables of several schedulers are set ({0}), so which one started this process is unclear; give --shard K/N")]
    Several(String),
    #[error("--shard auto: {var} is not set, though {index_var} is")]
    Missing {
        var: &'static str,
        index_var: &'static str,
    },
    #[error("--shard auto: {var}='{value}' is not a whole number")]
    NotANumber { var: &'static str, value: String },
    #[error("--shard auto: {0}")]
    Invalid(String),
}

/// The shard `--shard auto` (`count` None) or `--shard auto/N` takes, from the variables
/// `env` returns (`std::env::var` in the tool; a map in the tests). An empty variable counts
/// as unset.
pub fn detect(
    count: Option<usize>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Detected, AutoShardError> {
    let get = |var: &str| env(var).filter(|v| !v.trim().is_empty());
    let count = given_count(count, &get)?;
    let found: Vec<Scheduler> = Scheduler::ALL
        .into_iter()
        .filter(|s| get(s.index_var()).is_some())
        .collect();
    let scheduler = match found.as_slice() {
        [one] => *one,
        [] => return Err(not_found(&get)),
        several => {
            let list = several
                .iter()
                .map(|s| format!("{} for {}", s.index_var(), s.name()))
                .collect::<Vec<_>>()
                .join(", ");
            return Err(AutoShardError::Several(list));
        }
    };
    let index_var = scheduler.index_var();
    let number = |var: &'static str| -> Result<usize, AutoShardError> {
        let value = get(var).ok_or(AutoShardError::Missing { var, index_var })?;
        value
            .trim()
            .parse()
            .map_err(|_| AutoShardError::NotANumber { var, value })
    };
    let id = number(index_var)?;
    let invalid = |msg: String| Err(AutoShardError::Invalid(msg));

    // The array's shape as the scheduler states it: Slurm's lowest and highest task ID, or
    // the others' size (their indices run from 0).
    let (shard, from) = if scheduler == Scheduler::Slurm {
        let (min, max) = (
            number("SLURM_ARRAY_TASK_MIN")?,
            number("SLURM_ARRAY_TASK_MAX")?,
        );
        let tasks = number("SLURM_ARRAY_TASK_COUNT")?;
        let from = format!("{index_var}={id} of array {min}-{max} ({tasks} tasks)");
        if id < min || id > max || min > max {
            return invalid(format!(
                "SLURM_ARRAY_TASK_ID={id} lies outside SLURM_ARRAY_TASK_MIN={min}..SLURM_ARRAY_TASK_MAX={max}"
            ));
        }
        match count {
            Some(n) => {
                if max >= n {
                    return invalid(format!(
                        "the Slurm array reaches task {max}, but with N={n} the task IDs are the shard numbers 0..{}; submit --array=0-{} or give N={}",
                        n - 1,
                        n - 1,
                        max + 1
                    ));
                }
                (
                    Shard {
                        index: id,
                        count: n,
                    },
                    from,
                )
            }
            None => {
                if tasks != max - min + 1 {
                    return invalid(format!(
                        "the Slurm array {min}-{max} has {tasks} tasks, not {}: a stepped or sparse --array cannot be split as K/N; submit a contiguous range such as --array=0-{}, or give N with --shard auto/N (task IDs are then the shard numbers)",
                        max - min + 1,
                        tasks.max(1) - 1
                    ));
                }
                if tasks == 1 && id != 0 {
                    return invalid(format!(
                        "the Slurm array holds task {id} alone, which would take the whole list; to re-run shard {id} of N give --shard auto/N or {COUNT_VAR}=N, or --shard 0/1 for the whole list"
                    ));
                }
                (
                    Shard {
                        index: id - min,
                        count: tasks,
                    },
                    from,
                )
            }
        }
    } else {
        let size = match scheduler.count_var() {
            Some(var) => Some((var, number(var)?)),
            None => None,
        };
        let n = match (count, size) {
            (Some(n), Some((var, size))) if size > n => {
                return invalid(format!(
                    "{var}={size} is larger than N={n}: tasks {n}.. would have no shard"
                ));
            }
            (Some(n), _) => n,
            (None, Some((_, size))) => size,
            (None, None) => {
                return invalid(format!(
                    "{} gives no task count: give it as --shard auto/N or set {COUNT_VAR}=N (the Job's completions)",
                    scheduler.name()
                ));
            }
        };
        if n == 0 || id >= n {
            return invalid(format!(
                "{index_var}={id} is not below the count N={n} (indices run from 0)"
            ));
        }
        let from = match size {
            Some((var, size)) => format!("{index_var}={id}, {var}={size}"),
            None => format!("{index_var}={id}"),
        };
        (
            Shard {
                index: id,
                count: n,
            },
            from,
        )
    };
    Ok(Detected {
        scheduler,
        shard,
        from,
    })
}

/// N as `auto/N` or `UPSCALE_SHARD_COUNT` gives it; both at once must agree.
fn given_count(
    flag: Option<usize>,
    get: &impl Fn(&str) -> Option<String>,
) -> Result<Option<usize>, AutoShardError> {
    let from_env = match get(COUNT_VAR) {
        None => None,
        Some(value) => match value.trim().parse::<usize>() {
            Ok(n) if n > 0 => Some(n),
            _ => {
                return Err(AutoShardError::Invalid(format!(
                    "{COUNT_VAR}='{value}' must be a whole number of at least 1"
                )))
            }
        },
    };
    match (flag, from_env) {
        (Some(a), Some(b)) if a != b => Err(AutoShardError::Invalid(format!(
            "--shard auto/{a} and {COUNT_VAR}={b} disagree"
        ))),
        (a, b) => Ok(a.or(b)),
    }
}

/// No index variable: a scheduler's job that is not an array, or no scheduler at all.
fn not_found(get: &impl Fn(&str) -> Option<String>) -> AutoShardError {
    for s in Scheduler::ALL {
        if let Some(job_var) = s.job_var().filter(|v| get(v).is_some()) {
            return AutoShardError::NotAnArray {
                scheduler: s.name(),
                job_var,
                index_var: s.index_var(),
            };
        }
    }
    AutoShardError::NoScheduler
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn detect_with(
        count: Option<usize>,
        vars: &[(&str, &str)],
    ) -> Result<Detected, AutoShardError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        detect(count, |k| map.get(k).cloned())
    }

    fn shard(count: Option<usize>, vars: &[(&str, &str)]) -> (usize, usize) {
        let d = detect_with(count, vars).unwrap_or_else(|e| panic!("{vars:?}: {e}"));
        (d.shard.index, d.shard.count)
    }

    fn refusal(count: Option<usize>, vars: &[(&str, &str)]) -> String {
        match detect_with(count, vars) {
            Ok(d) => panic!("{vars:?} gave {d:?}, expected a refusal"),
            Err(e) => e.to_string(),
        }
    }

    fn slurm(id: &str, min: &str, max: &str, count: &str) -> Vec<(&'static str, String)> {
        vec![
            ("SLURM_JOB_ID", "77".into()),
            ("SLURM_ARRAY_TASK_ID", id.into()),
            ("SLURM_ARRAY_TASK_MIN", min.into()),
            ("SLURM_ARRAY_TASK_MAX", max.into()),
            ("SLURM_ARRAY_TASK_COUNT", count.into()),
        ]
    }

    fn refs<'a>(v: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
        v.iter().map(|(k, v)| (*k, v.as_str())).collect()
    }

    #[test]
    fn slurm_contiguous_arrays() {
        assert_eq!(shard(None, &refs(&slurm("0", "0", "3", "4"))), (0, 4));
        assert_eq!(shard(None, &refs(&slurm("3", "0", "3", "4"))), (3, 4));
        // A one-based array: K counts from its lowest task.
        assert_eq!(shard(None, &refs(&slurm("1", "1", "16", "16"))), (0, 16));
        assert_eq!(shard(None, &refs(&slurm("16", "1", "16", "16"))), (15, 16));
        // A lone task 0 is the whole list.
        assert_eq!(shard(None, &refs(&slurm("0", "0", "0", "1"))), (0, 1));
        let d = detect_with(None, &refs(&slurm("2", "0", "3", "4"))).unwrap();
        assert_eq!(d.scheduler, Scheduler::Slurm);
        assert_eq!(d.from, "SLURM_ARRAY_TASK_ID=2 of array 0-3 (4 tasks)");
    }

    #[test]
    fn slurm_stepped_or_sparse_arrays_are_refused() {
        // --array=0-15:4 runs 0, 4, 8, 12.
        let e = refusal(None, &refs(&slurm("4", "0", "12", "4")));
        assert!(
            e.contains("stepped or sparse") && e.contains("0-12 has 4 tasks"),
            "{e}"
        );
        // --array=1,3,7
        let e = refusal(None, &refs(&slurm("3", "1", "7", "3")));
        assert!(e.contains("1-7 has 3 tasks, not 7"), "{e}");
        // The same arrays are fine when N is given: the IDs are the shard numbers.
        assert_eq!(shard(Some(16), &refs(&slurm("4", "0", "12", "4"))), (4, 16));
        assert_eq!(shard(Some(8), &refs(&slurm("7", "1", "7", "3"))), (7, 8));
    }

    #[test]
    fn slurm_rerun_of_one_task() {
        // `sbatch --array=2`: without N it would take the whole list, so it is refused...
        let e = refusal(None, &refs(&slurm("2", "2", "2", "1")));
        assert!(e.contains("task 2 alone") && e.contains(COUNT_VAR), "{e}");
        // ...and with N it is shard 2 of N, from the flag or the variable.
        assert_eq!(shard(Some(4), &refs(&slurm("2", "2", "2", "1"))), (2, 4));
        let mut vars = slurm("2", "2", "2", "1");
        vars.push((COUNT_VAR, "4".into()));
        assert_eq!(shard(None, &refs(&vars)), (2, 4));
        assert_eq!(shard(Some(4), &refs(&vars)), (2, 4));
        let e = refusal(Some(5), &refs(&vars));
        assert!(e.contains("auto/5") && e.contains("=4 disagree"), "{e}");
    }

    #[test]
    fn slurm_ids_beyond_n_are_refused() {
        let e = refusal(Some(4), &refs(&slurm("1", "1", "4", "4")));
        assert!(
            e.contains("reaches task 4") && e.contains("--array=0-3"),
            "{e}"
        );
        let e = refusal(Some(4), &refs(&slurm("0", "0", "7", "8")));
        assert!(e.contains("reaches task 7"), "{e}");
    }

    #[test]
    fn slurm_variables_missing_or_malformed() {
        let vars = [("SLURM_JOB_ID", "77"), ("SLURM_ARRAY_TASK_ID", "1")];
        let e = refusal(None, &vars);
        assert!(e.contains("SLURM_ARRAY_TASK_MIN is not set"), "{e}");
        let e = refusal(None, &refs(&slurm("x", "0", "3", "4")));
        assert!(e.contains("SLURM_ARRAY_TASK_ID='x'"), "{e}");
        let e = refusal(None, &refs(&slurm("5", "0", "3", "4")));
        assert!(e.contains("outside"), "{e}");
        let e = refusal(None, &refs(&slurm("1", "0", "3", "-4")));
        assert!(e.contains("SLURM_ARRAY_TASK_COUNT='-4'"), "{e}");
    }

    #[test]
    fn jobs_that_are_not_arrays_are_refused() {
        let e = refusal(None, &[("SLURM_JOB_ID", "77")]);
        assert!(e.contains("Slurm job is not an array job"), "{e}");
        assert!(e.contains("SLURM_ARRAY_TASK_ID"), "{e}");
        let e = refusal(Some(4), &[("AWS_BATCH_JOB_ID", "abc")]);
        assert!(e.contains("AWS Batch job is not an array job"), "{e}");
        assert!(e.contains("AWS_BATCH_JOB_ARRAY_INDEX"), "{e}");
    }

    #[test]
    fn no_scheduler() {
        assert_eq!(detect_with(None, &[]), Err(AutoShardError::NoScheduler));
        // Set but empty is unset; unrelated variables change nothing.
        assert_eq!(
            detect_with(Some(4), &[("JOB_COMPLETION_INDEX", ""), ("HOME", "/")]),
            Err(AutoShardError::NoScheduler)
        );
        let e = AutoShardError::NoScheduler.to_string();
        assert!(e.contains("--shard K/N") && !e.contains('\n'), "{e}");
    }

    #[test]
    fn kubernetes_needs_n() {
        let e = refusal(None, &[("JOB_COMPLETION_INDEX", "3")]);
        assert!(
            e.contains("gives no task count") && e.contains(COUNT_VAR),
            "{e}"
        );
        assert_eq!(shard(Some(8), &[("JOB_COMPLETION_INDEX", "3")]), (3, 8));
        assert_eq!(
            shard(None, &[("JOB_COMPLETION_INDEX", "7"), (COUNT_VAR, "8")]),
            (7, 8)
        );
        let e = refusal(None, &[("JOB_COMPLETION_INDEX", "8"), (COUNT_VAR, "8")]);
        assert!(e.contains("not below the count N=8"), "{e}");
        for bad in ["0", "x", "-1"] {
            let e = refusal(None, &[("JOB_COMPLETION_INDEX", "0"), (COUNT_VAR, bad)]);
            assert!(e.contains(&format!("{COUNT_VAR}='{bad}'")), "{e}");
        }
        let d = detect_with(Some(8), &[("JOB_COMPLETION_INDEX", "3")]).unwrap();
        assert_eq!(d.scheduler, Scheduler::Kubernetes);
        assert_eq!(d.from, "JOB_COMPLETION_INDEX=3");
    }

    #[test]
    fn aws_batch() {
        let vars = [
            ("AWS_BATCH_JOB_ID", "abc:5"),
            ("AWS_BATCH_JOB_ARRAY_INDEX", "5"),
            ("AWS_BATCH_JOB_ARRAY_SIZE", "10"),
        ];
        assert_eq!(shard(None, &vars), (5, 10));
        assert_eq!(shard(Some(12), &vars), (5, 12));
        let e = refusal(Some(8), &vars);
        assert!(
            e.contains("AWS_BATCH_JOB_ARRAY_SIZE=10 is larger than N=8"),
            "{e}"
        );
        let e = refusal(None, &vars[..2]);
        assert!(e.contains("AWS_BATCH_JOB_ARRAY_SIZE is not set"), "{e}");
        let e = refusal(
            None,
            &[
                ("AWS_BATCH_JOB_ARRAY_INDEX", "10"),
                ("AWS_BATCH_JOB_ARRAY_SIZE", "10"),
            ],
        );
        assert!(e.contains("not below the count N=10"), "{e}");
    }

    #[test]
    fn google_cloud_batch() {
        let vars = [("BATCH_TASK_INDEX", "0"), ("BATCH_TASK_COUNT", "3")];
        assert_eq!(shard(None, &vars), (0, 3));
        let d = detect_with(None, &vars).unwrap();
        assert_eq!(d.scheduler, Scheduler::GoogleBatch);
        assert_eq!(d.from, "BATCH_TASK_INDEX=0, BATCH_TASK_COUNT=3");
        let e = refusal(
            None,
            &[("BATCH_TASK_INDEX", "0"), ("BATCH_TASK_COUNT", "0")],
        );
        assert!(e.contains("not below the count N=0"), "{e}");
    }

    #[test]
    fn two_schedulers_at_once_are_refused() {
        let mut vars = slurm("1", "0", "3", "4");
        vars.push(("JOB_COMPLETION_INDEX", "1".into()));
        let e = refusal(Some(4), &refs(&vars));
        assert!(
            e.contains("SLURM_ARRAY_TASK_ID for Slurm")
                && e.contains("JOB_COMPLETION_INDEX for Kubernetes"),
            "{e}"
        );
        // A job marker of another scheduler (not its index) does not count.
        let mut vars = slurm("1", "0", "3", "4");
        vars.push(("AWS_BATCH_JOB_ID", "abc".into()));
        assert_eq!(shard(None, &refs(&vars)), (1, 4));
    }
}
