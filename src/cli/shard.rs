//! Splitting one input list across independent processes (`--shard K/N`, or `--shard auto`
//! to read K and N from the job array that started the process: [`super::scheduler`]).
//!
//! K is 0-based, K in 0..N, to take `$SLURM_ARRAY_TASK_ID` (with `--array=0-<N-1>`) or
//! Kubernetes' `$JOB_COMPLETION_INDEX` as is. File i of the sorted list goes to shard
//! i mod N: deterministic, disjoint, covering, and within one file of even.
//!
//! Shard the full sorted list, before dropping inputs whose outputs exist, so that every
//! process computes the same split however far the others have got.

use std::fmt;
use std::str::FromStr;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shard {
    /// 0-based, less than `count`.
    pub index: usize,
    pub count: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid shard '{spec}': {reason} (expected K/N with 0 <= K < N, e.g. 0/4, or auto, or auto/N)"
)]
pub struct ShardError {
    pub spec: String,
    pub reason: &'static str,
}

pub fn parse_shard(spec: &str) -> Result<Shard, ShardError> {
    let err = |reason| ShardError {
        spec: spec.to_string(),
        reason,
    };
    let (k, n) = spec.trim().split_once('/').ok_or_else(|| err("no '/'"))?;
    let index: usize = k.trim().parse().map_err(|_| err("K is not a number"))?;
    let count: usize = n.trim().parse().map_err(|_| err("N is not a number"))?;
    if count == 0 {
        return Err(err("N must be at least 1"));
    }
    if index >= count {
        return Err(err("K must be less than N (K is 0-based)"));
    }
    Ok(Shard { index, count })
}

/// What `--shard` asked for: a fixed K/N, or the scheduler's index (`auto`), with N given
/// (`auto/N`) or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardSpec {
    Fixed(Shard),
    Auto { count: Option<usize> },
}

pub fn parse_shard_spec(spec: &str) -> Result<ShardSpec, ShardError> {
    let trimmed = spec.trim();
    let (head, tail) = match trimmed.split_once('/') {
        Some((h, t)) => (h.trim(), Some(t.trim())),
        None => (trimmed, None),
    };
    if !head.eq_ignore_ascii_case("auto") {
        return parse_shard(spec).map(ShardSpec::Fixed);
    }
    let count = match tail {
        None => None,
        Some(n) => match n.parse::<usize>() {
            Ok(n) if n > 0 => Some(n),
            _ => {
                return Err(ShardError {
                    spec: spec.to_string(),
                    reason: "N in auto/N must be a whole number of at least 1",
                })
            }
        },
    };
    Ok(ShardSpec::Auto { count })
}

impl FromStr for Shard {
    type Err = ShardError;
    fn from_str(s: &str) -> Result<Shard, ShardError> {
        parse_shard(s)
    }
}

impl fmt::Display for Shard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

/// Keeps the items of shard `shard` from an already sorted list, in order.
pub fn select_shard<T>(items: Vec<T>, shard: Shard) -> Vec<T> {
    items
        .into_iter()
        .enumerate()
        .filter(|(i, _)| i % shard.count == shard.index)
        .map(|(_, item)| item)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_zero_based_k_of_n() {
        assert_eq!(parse_shard("0/1"), Ok(Shard { index: 0, count: 1 }));
        assert_eq!(parse_shard(" 3/4 "), Ok(Shard { index: 3, count: 4 }));
        assert_eq!("2/5".parse::<Shard>().unwrap().to_string(), "2/5");
        for bad in ["4/4", "1/0", "0/0", "-1/3", "a/3", "1", "", "1/2/3", "1/x"] {
            let e = parse_shard(bad).unwrap_err();
            assert!(e.to_string().contains(&format!("'{bad}'")), "{e}");
        }
    }

    #[test]
    fn parses_auto() {
        assert_eq!(
            parse_shard_spec("auto"),
            Ok(ShardSpec::Auto { count: None })
        );
        assert_eq!(
            parse_shard_spec(" AUTO/16 "),
            Ok(ShardSpec::Auto { count: Some(16) })
        );
        assert_eq!(
            parse_shard_spec("1/2"),
            Ok(ShardSpec::Fixed(Shard { index: 1, count: 2 }))
        );
        for bad in ["auto/0", "auto/x", "auto/", "auto/1/2", "automatic", "2/2"] {
            let e = parse_shard_spec(bad).unwrap_err();
            assert!(e.to_string().contains(&format!("'{bad}'")), "{e}");
        }
    }

    #[test]
    fn shards_are_balanced() {
        let items: Vec<usize> = (0..10).collect();
        let sizes: Vec<usize> = (0..3)
            .map(|k| select_shard(items.clone(), Shard { index: k, count: 3 }).len())
            .collect();
        assert_eq!(sizes, [4, 3, 3]);
        assert_eq!(select_shard(items, Shard { index: 1, count: 3 }), [1, 4, 7]);
    }

    proptest! {
        #[test]
        fn shards_are_disjoint_and_cover_the_list(len in 0usize..60, n in 1usize..=7) {
            let items: Vec<usize> = (0..len).collect();
            let mut union = Vec::new();
            for k in 0..n {
                let part = select_shard(items.clone(), Shard { index: k, count: n });
                // Deterministic: the same call gives the same part.
                prop_assert_eq!(&part, &select_shard(items.clone(), Shard { index: k, count: n }));
                prop_assert!(part.len() <= len / n + 1 && part.len() >= len / n);
                union.extend(part);
            }
            union.sort();
            // Sorted union equal to the list: nothing lost, nothing taken twice.
            prop_assert_eq!(union, items);
        }
    }
}
