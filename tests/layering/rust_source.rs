//! The module paths a Rust source file names outside its test code: enough of a Rust reader
//! for the layering test (which module may name which) without a parser dependency.
//!
//! It tokenizes (skipping comments, strings and character literals), drops every item marked
//! `#[cfg(test)]`, tracks inline `mod name { ... }` blocks, expands `use` trees, and resolves
//! every path that starts with `crate`, `self` or `super` to an absolute path such as
//! `crate::backend::cpu::Host`. Paths through a name brought in by `use` are covered by the
//! `use` itself.

/// The absolute paths (`crate::a::b::...`) that the non-test code of the source `text` of
/// module `module` (e.g. `["crate", "backend", "cuda", "backend"]`) names, in order of
/// appearance.
pub fn named_paths(module: &[&str], text: &str) -> Vec<String> {
    let tokens = tokenize(text);
    let mut reader = Reader {
        tokens: &tokens,
        pos: 0,
        module: module.iter().map(|s| s.to_string()).collect(),
        inline: Vec::new(),
        depth: 0,
        paths: Vec::new(),
    };
    reader.run();
    reader.paths
}

/// The module path of the file at `relative` (relative to `src/`, `/`-separated):
/// `lib.rs` is `crate`, `a/mod.rs` and `a.rs` are `crate::a`.
pub fn module_of(relative: &str) -> Vec<String> {
    let mut path = vec!["crate".to_string()];
    let parts: Vec<&str> = relative.trim_end_matches(".rs").split('/').collect();
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        if last && (*part == "mod" || (*part == "lib" && parts.len() == 1)) {
            break;
        }
        path.push(part.to_string());
    }
    path
}

/// A token: an identifier or keyword, `::`, or one punctuation character.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Ident(String),
    PathSep,
    Punct(char),
}

/// The tokens of `text` that matter for paths; comments, strings, character literals and
/// numbers are dropped.
fn tokenize(text: &str) -> Vec<Token> {
    let chars: Vec<char> = text.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            i = skip_block_comment(&chars, i);
        } else if c == '"' {
            i = skip_string(&chars, i + 1, 0);
        } else if c == '\'' {
            i = skip_quote(&chars, i);
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let hashes = chars[i..].iter().take_while(|&&c| c == '#').count();
            let quote = chars.get(i + hashes).copied();
            match (word.as_str(), quote) {
                // Raw strings: r"..", r#".."#, br"..".
                ("r" | "br", Some('"')) => i = skip_string(&chars, i + hashes + 1, hashes),
                // Byte strings and byte characters.
                ("b", Some('"')) if hashes == 0 => i = skip_string(&chars, i + 1, 0),
                ("b", Some('\'')) if hashes == 0 => i = skip_quote(&chars, i),
                _ => tokens.push(Token::Ident(word)),
            }
        } else if c.is_ascii_digit() {
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
        } else if c == ':' && next == Some(':') {
            tokens.push(Token::PathSep);
            i += 2;
        } else {
            if !c.is_whitespace() {
                tokens.push(Token::Punct(c));
            }
            i += 1;
        }
    }
    tokens
}

/// The index after the (possibly nested) block comment starting at `i`.
fn skip_block_comment(chars: &[char], mut i: usize) -> usize {
    let mut depth = 0;
    while i < chars.len() {
        if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
            depth += 1;
            i += 2;
        } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            i += 1;
        }
    }
    i
}

/// The index after a string whose contents start at `i` and which ends with `"` followed by
/// `hashes` `#`s (0 for an ordinary string, where backslash escapes apply).
fn skip_string(chars: &[char], mut i: usize, hashes: usize) -> usize {
    while i < chars.len() {
        if hashes == 0 && chars[i] == '\\' {
            i += 2;
        } else if chars[i] == '"' && chars[i + 1..].iter().take(hashes).all(|&c| c == '#') {
            return i + 1 + hashes;
        } else {
            i += 1;
        }
    }
    i
}

/// The index after the character literal or lifetime whose `'` is at `i`.
fn skip_quote(chars: &[char], i: usize) -> usize {
    match (chars.get(i + 1), chars.get(i + 2)) {
        (Some('\\'), _) => {
            let mut j = i + 2;
            while j < chars.len() && chars[j] != '\'' {
                j += 1;
            }
            j + 1
        }
        (Some(_), Some('\'')) => i + 3,
        // A lifetime or label: the name that follows is read as an identifier.
        _ => i + 1,
    }
}

/// Walks the tokens of one file, collecting resolved paths.
struct Reader<'a> {
    tokens: &'a [Token],
    pos: usize,
    /// The file's module path.
    module: Vec<String>,
    /// Inline modules entered, with the brace depth at which each was opened.
    inline: Vec<(String, usize)>,
    depth: usize,
    paths: Vec<String>,
}

impl Reader<'_> {
    fn peek(&self, ahead: usize) -> Option<&Token> {
        self.tokens.get(self.pos + ahead)
    }

    fn ident(&self, ahead: usize) -> Option<&str> {
        match self.peek(ahead) {
            Some(Token::Ident(s)) => Some(s),
            _ => None,
        }
    }

    fn run(&mut self) {
        while self.pos < self.tokens.len() {
            if self.at_cfg_test() {
                self.pos += 7;
                self.skip_item();
                continue;
            }
            match self.peek(0).cloned() {
                Some(Token::Punct('{')) => {
                    self.depth += 1;
                    self.pos += 1;
                }
                Some(Token::Punct('}')) => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.inline.last().is_some_and(|&(_, d)| d == self.depth) {
                        self.inline.pop();
                    }
                    self.pos += 1;
                }
                Some(Token::Ident(word)) if word == "mod" => {
                    if let (Some(name), Some(Token::Punct('{'))) =
                        (self.ident(1).map(str::to_string), self.peek(2))
                    {
                        self.inline.push((name, self.depth));
                    }
                    self.pos += 1;
                }
                Some(Token::Ident(word)) if word == "use" => {
                    self.pos += 1;
                    let mut found = Vec::new();
                    self.use_tree(Vec::new(), &mut found);
                    for path in found {
                        self.record(&path);
                    }
                }
                Some(Token::Ident(word))
                    if matches!(word.as_str(), "crate" | "self" | "super")
                        && self.peek(1) == Some(&Token::PathSep) =>
                {
                    let mut path = vec![word];
                    self.pos += 1;
                    while self.peek(0) == Some(&Token::PathSep) {
                        match self.ident(1) {
                            Some(next) => {
                                path.push(next.to_string());
                                self.pos += 2;
                            }
                            None => break,
                        }
                    }
                    self.record(&path);
                }
                _ => self.pos += 1,
            }
        }
    }

    /// Whether the tokens at the cursor are `# [ cfg ( test ) ]`.
    fn at_cfg_test(&self) -> bool {
        self.peek(0) == Some(&Token::Punct('#'))
            && self.peek(1) == Some(&Token::Punct('['))
            && self.ident(2) == Some("cfg")
            && self.peek(3) == Some(&Token::Punct('('))
            && self.ident(4) == Some("test")
            && self.peek(5) == Some(&Token::Punct(')'))
            && self.peek(6) == Some(&Token::Punct(']'))
    }

    /// Skips the item at the cursor: up to its `;`, or through its `{ ... }` body.
    fn skip_item(&mut self) {
        let mut depth = 0usize;
        while let Some(token) = self.peek(0).cloned() {
            self.pos += 1;
            match token {
                Token::Punct('{') => depth += 1,
                Token::Punct('}') => {
                    depth -= 1;
                    if depth == 0 {
                        return;
                    }
                }
                Token::Punct(';') if depth == 0 => return,
                _ => {}
            }
        }
    }

    /// Reads one use tree at the cursor, appending its full paths (relative, as written, with
    /// `prefix` in front) to `found`; stops after the tree.
    fn use_tree(&mut self, prefix: Vec<String>, found: &mut Vec<Vec<String>>) {
        let mut path = prefix;
        loop {
            match self.peek(0).cloned() {
                Some(Token::Ident(word)) if word == "as" => self.pos += 2,
                Some(Token::Ident(word)) => {
                    if word != "self" || path.is_empty() {
                        path.push(word);
                    }
                    self.pos += 1;
                }
                Some(Token::PathSep) => self.pos += 1,
                Some(Token::Punct('*')) => self.pos += 1,
                Some(Token::Punct('{')) => {
                    self.pos += 1;
                    loop {
                        self.use_tree(path.clone(), found);
                        match self.peek(0) {
                            Some(Token::Punct(',')) => self.pos += 1,
                            _ => break,
                        }
                        if self.peek(0) == Some(&Token::Punct('}')) {
                            break;
                        }
                    }
                    self.pos += 1; // the closing brace
                    if self.peek(0) == Some(&Token::Punct(';')) {
                        self.pos += 1;
                    }
                    return;
                }
                Some(Token::Punct(';')) => {
                    self.pos += 1;
                    found.push(path);
                    return;
                }
                _ => {
                    found.push(path);
                    return;
                }
            }
        }
    }

    /// Resolves `path` against the current module and records it when it is crate-relative.
    fn record(&mut self, path: &[String]) {
        let mut module = self.module.clone();
        module.extend(self.inline.iter().map(|(name, _)| name.clone()));
        let mut segments = path.iter().peekable();
        let mut resolved = match segments.peek().map(|s| s.as_str()) {
            Some("crate") => {
                segments.next();
                vec!["crate".to_string()]
            }
            Some("self") => {
                segments.next();
                module
            }
            Some("super") => {
                while segments.peek().map(|s| s.as_str()) == Some("super") {
                    segments.next();
                    module.pop();
                }
                module
            }
            _ => return,
        };
        resolved.extend(segments.cloned());
        self.paths.push(resolved.join("::"));
    }
}
