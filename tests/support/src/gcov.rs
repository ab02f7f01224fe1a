//! Line and function execution counts of a host build compiled with `--coverage`, read from
//! `gcov --json-format --stdout` (gcc 12's format 1), summed over translation units and
//! template instances, files named by their base name.

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

use crate::json::Json;
use crate::source_loops::block_end;

/// A function (or lambda) of a source file: its lines and how often it was called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FunctionSpan {
    /// First and last line of its definition, and the column it starts at.
    pub start: u32,
    pub end: u32,
    pub column: u32,
    /// Calls, summed over its instances.
    pub calls: u64,
}

/// The counts of one run of a host build.
#[derive(Debug, Clone, Default)]
pub struct Coverage {
    /// Executions of each line (gcov's count: entries into its blocks from other lines).
    lines: HashMap<(String, u32), u64>,
    functions: HashMap<String, Vec<FunctionSpan>>,
}

/// The base name of a path as gcov or a disassembler reports it.
pub fn base_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

impl Coverage {
    /// The counts of gcov's JSON documents (one per data file) in `text`.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let mut coverage = Coverage::default();
        for document in Json::parse_all(text)? {
            coverage.add_document(&document)?;
        }
        for spans in coverage.functions.values_mut() {
            spans.sort_by_key(|s| (s.start, s.end));
        }
        Ok(coverage)
    }

    fn add_document(&mut self, document: &Json) -> Result<(), String> {
        let bad = |what: &str| format!("gcov JSON: {what}");
        for file in document.get("files").map(Json::items).unwrap_or_default() {
            let name = file
                .get("file")
                .and_then(Json::as_str)
                .ok_or_else(|| bad("a file without a name"))?;
            let name = base_name(name).to_owned();
            for line in file.get("lines").map(Json::items).unwrap_or_default() {
                let number = line.get("line_number").and_then(Json::as_u64);
                let count = line.get("count").and_then(Json::as_u64);
                let (Some(number), Some(count)) = (number, count) else {
                    return Err(bad("a line without number or count"));
                };
                *self.lines.entry((name.clone(), number as u32)).or_default() += count;
            }
            for function in file.get("functions").map(Json::items).unwrap_or_default() {
                let field = |key: &str| function.get(key).and_then(Json::as_u64);
                let (Some(start), Some(end), Some(column), Some(calls)) = (
                    field("start_line"),
                    field("end_line"),
                    field("start_column"),
                    field("execution_count"),
                ) else {
                    return Err(bad("a function without lines or count"));
                };
                let spans = self.functions.entry(name.clone()).or_default();
                let (start, end, column) = (start as u32, end as u32, column as u32);
                match spans
                    .iter_mut()
                    .find(|s| s.start == start && s.column == column)
                {
                    Some(span) => span.calls += calls,
                    None => spans.push(FunctionSpan {
                        start,
                        end,
                        column,
                        calls,
                    }),
                }
            }
        }
        Ok(())
    }

    /// Runs gcov on every `.gcda` file of `dir` (which also holds the build's `.gcno` files)
    /// and reads its report.
    pub fn of_run(dir: &Path) -> Result<Self, String> {
        let mut data: Vec<_> = std::fs::read_dir(dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|path| path.extension().is_some_and(|x| x == "gcda"))
            .collect();
        data.sort();
        if data.is_empty() {
            return Err(format!("no .gcda file in {}", dir.display()));
        }
        let out = Command::new("gcov")
            .args(["--json-format", "--stdout"])
            .arg("--object-directory")
            .arg(dir)
            .args(&data)
            .current_dir(dir)
            .output()
            .map_err(|e| format!("start gcov: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "gcov failed ({}):\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Self::from_json(&String::from_utf8_lossy(&out.stdout))
    }

    /// These counts with the spans of the functions gcov gives as one line extended to the
    /// brace that closes their body in `sources` (by base name): gcc 12 reports a lambda's
    /// first line as its last.
    pub fn with_lambda_spans(mut self, sources: &HashMap<String, String>) -> Self {
        for (file, spans) in &mut self.functions {
            let Some(source) = sources.get(file) else {
                continue;
            };
            for span in spans.iter_mut().filter(|s| s.start == s.end) {
                if let Some(end) = block_end(source, span.start, span.column) {
                    span.end = end;
                }
            }
        }
        self
    }

    /// Whether the build compiled `file` (a base name).
    pub fn has_file(&self, file: &str) -> bool {
        self.functions.contains_key(file)
    }

    /// The executions of `line` of `file`, when gcov reports it (a line with code).
    pub fn line(&self, file: &str, line: u32) -> Option<u64> {
        self.lines.get(&(file.to_owned(), line)).copied()
    }

    /// The innermost function of `file` whose definition holds `line`.
    pub fn function_at(&self, file: &str, line: u32) -> Option<FunctionSpan> {
        self.functions
            .get(file)?
            .iter()
            .filter(|s| s.start <= line && line <= s.end)
            .min_by_key(|s| s.end - s.start)
            .copied()
    }

    /// The executions of `line` of `file`; for a line gcov does not report (no code of its
    /// own in the host build), those of the nearest reported line before it in the same
    /// function, or else after it. `None` outside every function.
    pub fn count_near(&self, file: &str, line: u32) -> Option<u64> {
        if let Some(known) = self.line(file, line) {
            return Some(known);
        }
        let span = self.function_at(file, line)?;
        (span.start..line)
            .rev()
            .chain(line + 1..=span.end)
            .find_map(|l| self.line(file, l))
    }
}
