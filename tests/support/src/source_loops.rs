//! The loops of a CUDA C++ source: each `for` or `while` statement with a braced body, its
//! header line, the lines of its body and the lines of the `break` statements that leave it.
//! Comments, string and character literals and preprocessor lines are skipped; a loop without
//! braces is refused (the kernels' style always has them), so that no loop goes unseen.

/// One loop statement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceLoop {
    /// The line of its keyword (where -O0 code and a disassembler put its condition).
    pub header: u32,
    /// The last line of its body (its closing brace).
    pub last: u32,
    /// The lines of the `break` statements that leave this loop (not an inner loop or switch).
    pub breaks: Vec<u32>,
}

impl SourceLoop {
    /// Whether `line` lies in the statement (its header or body).
    pub fn holds(&self, line: u32) -> bool {
        self.header <= line && line <= self.last
    }
}

/// The loops of `source`, in order of their headers; an error names a loop without braces.
pub fn source_loops(source: &str) -> Result<Vec<SourceLoop>, String> {
    let code = code_only(source);
    let bytes = code.as_bytes();
    let line_of = |at: usize| 1 + bytes[..at].iter().filter(|&&b| b == b'\n').count() as u32;
    // Statements that scope `break`: (keyword, body start, body end) by byte offset.
    let mut scopes: Vec<(&str, usize, usize)> = Vec::new();
    let mut breaks = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let Some((word, end)) = identifier_at(bytes, at) else {
            at += 1;
            continue;
        };
        match word {
            "for" | "while" | "switch" => {
                let open = skip_space(bytes, end);
                if bytes.get(open) != Some(&b'(') {
                    at = end;
                    continue;
                }
                let close = matching(bytes, open, b'(', b')')
                    .ok_or_else(|| format!("line {}: unbalanced '('", line_of(open)))?;
                let brace = skip_space(bytes, close + 1);
                if bytes.get(brace) != Some(&b'{') {
                    return Err(format!(
                        "line {}: `{word}` without a braced body",
                        line_of(at)
                    ));
                }
                let body_end = matching(bytes, brace, b'{', b'}')
                    .ok_or_else(|| format!("line {}: unbalanced '{{'", line_of(brace)))?;
                scopes.push((word, at, body_end));
            }
            "break" => breaks.push(at),
            _ => {}
        }
        at = end;
    }
    let mut loops: Vec<SourceLoop> = Vec::new();
    let mut keyed = Vec::new();
    for &(word, start, end) in &scopes {
        if word != "switch" {
            keyed.push((start, loops.len()));
            loops.push(SourceLoop {
                header: line_of(start),
                last: line_of(end),
                breaks: Vec::new(),
            });
        }
    }
    for b in breaks {
        // The innermost scope around the `break` takes it.
        let owner = scopes
            .iter()
            .filter(|(_, start, end)| *start < b && b < *end)
            .max_by_key(|(_, start, _)| *start)
            .ok_or_else(|| format!("line {}: `break` outside a loop", line_of(b)))?;
        if let Some(&(_, index)) = keyed.iter().find(|(start, _)| *start == owner.1) {
            loops[index].breaks.push(line_of(b));
        }
    }
    Ok(loops)
}

/// The line of the brace that closes the first block opened at or after column `column` of
/// line `line` (both 1-based) of `source`.
pub fn block_end(source: &str, line: u32, column: u32) -> Option<u32> {
    let code = code_only(source);
    let bytes = code.as_bytes();
    let line_start: usize = code
        .split_inclusive('\n')
        .take(line.saturating_sub(1) as usize)
        .map(str::len)
        .sum();
    let from = line_start + column.saturating_sub(1) as usize;
    let open = from + bytes.get(from..)?.iter().position(|&b| b == b'{')?;
    let close = matching(bytes, open, b'{', b'}')?;
    Some(1 + bytes[..close].iter().filter(|&&b| b == b'\n').count() as u32)
}

/// `source` with comments, literals and preprocessor lines blanked (newlines kept, so byte
/// offsets keep their lines).
fn code_only(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut chars = source.chars().peekable();
    let mut line_start = true;
    while let Some(c) = chars.next() {
        let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
        match c {
            '#' if line_start => {
                // A preprocessor line (continuations included).
                out.push(' ');
                let mut previous = c;
                while let Some(&n) = chars.peek() {
                    if n == '\n' && previous != '\\' {
                        break;
                    }
                    previous = n;
                    out.push(blank(n));
                    chars.next();
                }
            }
            '/' if chars.peek() == Some(&'/') => {
                while let Some(&n) = chars.peek() {
                    if n == '\n' {
                        break;
                    }
                    out.push(' ');
                    chars.next();
                }
                out.push(' ');
            }
            '/' if chars.peek() == Some(&'*') => {
                out.push(' ');
                let mut previous = ' ';
                for n in chars.by_ref() {
                    out.push(blank(n));
                    if previous == '*' && n == '/' {
                        break;
                    }
                    previous = n;
                }
            }
            '"' | '\'' => {
                out.push(' ');
                let mut escaped = false;
                for n in chars.by_ref() {
                    out.push(blank(n));
                    if !escaped && n == c {
                        break;
                    }
                    escaped = !escaped && n == '\\';
                }
            }
            _ => out.push(c),
        }
        line_start = c == '\n' || (line_start && c.is_whitespace());
    }
    out
}

/// The identifier starting at `at` (not in the middle of one) and the offset after it.
fn identifier_at(bytes: &[u8], at: usize) -> Option<(&str, usize)> {
    let ident = |b: &u8| b.is_ascii_alphanumeric() || *b == b'_';
    if !ident(&bytes[at]) || (at > 0 && ident(&bytes[at - 1])) {
        return None;
    }
    let end = at + bytes[at..].iter().take_while(|b| ident(b)).count();
    std::str::from_utf8(&bytes[at..end]).ok().map(|w| (w, end))
}

fn skip_space(bytes: &[u8], mut at: usize) -> usize {
    while bytes.get(at).is_some_and(u8::is_ascii_whitespace) {
        at += 1;
    }
    at
}

/// The offset of the bracket closing the one at `open`.
fn matching(bytes: &[u8], open: usize, opening: u8, closing: u8) -> Option<usize> {
    let mut depth = 0usize;
    for (i, &b) in bytes.iter().enumerate().skip(open) {
        if b == opening {
            depth += 1;
        } else if b == closing {
            depth -= 1;
            if depth == 0 {
                return Some(i);
            }
        }
    }
    None
}
