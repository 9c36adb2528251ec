//! The library's modules depend on each other in one direction only: read from the sources,
//! the graph of `crate::<module>` references between the top-level modules has no cycle, and
//! the floors (`switches`, then `gpu`) reach nothing above them. Test code and the
//! command-line tool are left out: they may reach anywhere.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Top-level module -> the top-level modules its non-test code names as `crate::<name>`.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let rel = path
                .strip_prefix(src)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            let file = rel.rsplit('/').next().unwrap_or("");
            let skipped = rel.starts_with("tests/") || rel.starts_with("cli/");
            if !rel.ends_with(".rs") || skipped || rel == "main.rs" || file.contains("tests") {
                continue;
            }
            let module = rel
                .split('/')
                .next()
                .unwrap()
                .trim_end_matches(".rs")
                .to_string();
            let text = std::fs::read_to_string(&path).unwrap();
            // A file's own test module comes last; what follows it is test code.
            let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or("");
            let deps = g.entry(module.clone()).or_default();
            for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
                for part in line.split("crate::").skip(1) {
                    let name: String = part
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    if !name.is_empty() && name != module {
                        deps.insert(name);
                    }
                }
            }
        }
    }
    g
}

/// A cycle through `node`, if the graph has one reachable from it.
fn cycle_from(
    g: &BTreeMap<String, BTreeSet<String>>,
    node: &str,
    path: &mut Vec<String>,
) -> Option<Vec<String>> {
    if let Some(i) = path.iter().position(|n| n == node) {
        let mut cycle = path[i..].to_vec();
        cycle.push(node.to_string());
        return Some(cycle);
    }
    path.push(node.to_string());
    for next in g.get(node).into_iter().flatten() {
        if let Some(c) = cycle_from(g, next, path) {
            return Some(c);
        }
    }
    path.pop();
    None
}

#[test]
fn top_level_modules_form_no_cycle_and_the_floors_reach_nothing_above() {
    let g = graph(&super::repo().join("src"));
    for expected in ["nets", "ops", "checkpoint", "switches", "engine", "tile"] {
        assert!(g.contains_key(expected), "no module {expected}: {g:?}");
    }
    for node in g.keys() {
        if let Some(c) = cycle_from(&g, node, &mut Vec::new()) {
            panic!("import cycle: {}", c.join(" -> "));
        }
    }
    assert_eq!(g["switches"], BTreeSet::new(), "switches is the floor");
    let gpu: Vec<&str> = g
        .get("gpu")
        .into_iter()
        .flatten()
        .map(String::as_str)
        .collect();
    assert!(gpu.iter().all(|d| *d == "switches"), "gpu reaches {gpu:?}");
    // The networks never reach the checkpoint readers or the engine above them.
    for above in ["checkpoint", "engine", "model", "tile", "api"] {
        assert!(!g["nets"].contains(above), "nets reaches {above}");
    }
}

#[test]
fn a_cycle_is_found_when_there_is_one() {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    g.entry("a".into()).or_default().insert("b".into());
    g.entry("b".into()).or_default().insert("c".into());
    assert_eq!(cycle_from(&g, "a", &mut Vec::new()), None);
    g.entry("c".into()).or_default().insert("a".into());
    let c = cycle_from(&g, "a", &mut Vec::new()).unwrap();
    assert_eq!(c, ["a", "b", "c", "a"]);
}
