//! A Go `text/template` engine over `serde_json::Value` data, so that Weir renders Istio's
//! Envoy bootstrap template exactly as pilot-agent does.
//!
//! [`Template::parse`] turns the text into a tree: text, `{{pipeline}}` actions, comments, trim
//! markers, `if`/`else if`/`else`, `with`/`else with`, `range`/`else`, `break`/`continue`,
//! variables (`$x :=`, `$x =`, `$i, $v :=` in range), pipelines with `|`, parenthesised
//! pipelines and literals. [`Template::render`] walks the tree over JSON data. [`Functions`]
//! holds what templates may call: Go's builtins plus the embedder's (see
//! [`Functions::with_istio`] for Istio's `toJson`/`toJSON`).
//!
//! Data behaves as the same values inside Go's `map[string]interface{}`: objects are maps
//! (iterated, printed and marshalled in sorted key order), integers written without `.`/`e` are
//! Go `int`s and other numbers `float64`s, a missing key is Go's "no value" (printed `<no value>`,
//! false), null is a nil `interface{}`. As in Go, a pipeline's result that is a nil interface
//! becomes "no value", so `{{.k}}` prints `<no value>` for a null `k` too, while a null inside an
//! array or passed to `print`/`printf` prints `<nil>`.
//!
//! Differences from Go, all outside what Istio's bootstrap template uses:
//! - `define`, `template` and `block` are rejected at parse time; `call` and `slice` don't exist.
//! - `printf` knows flags `-+# 0`, width, precision and verbs `v s d t q x X o b c e E f F g G`;
//!   not `*`, `[n]` or `%#v`'s Go syntax.
//! - `js` and `%q` judge printability with Rust's Unicode data plus a list of format and
//!   private-use ranges: unassigned code points stay as they are, where Go escapes them.
//! - A JSON object can't say it was a Go struct: `toJson` writes sorted keys where Go writes struct
//!   fields in declaration order (Istio's `histogram_buckets`: same JSON, other key order).
//! - Errors carry a 1-based line and column (Go: line only when parsing, a byte offset when
//!   executing) and no `at <node>` part; messages name JSON's Go types (`string`,
//!   `[]interface {}`) where Go may say `interface {}`. Some errors come at parse time where Go
//!   finds them executing: assigning an undeclared variable, a variable used in its own
//!   declaration, integer literals beyond int64. Complex and hex-float literals are rejected,
//!   and nesting is limited to 100 levels.

mod arity;
mod error;
mod exec;
mod format;
mod funcs;
mod lex;
mod parse;
#[cfg(test)]
mod robustness;
#[cfg(test)]
mod tests;
mod value;

use serde_json::Value;

pub use self::error::{ErrorKind, Phase, TemplateError};
pub use self::format::to_json;
pub use self::{arity::Arity, funcs::Functions};

/// A parsed template, ready to render any number of times.
#[derive(Debug, Clone)]
pub struct Template {
    name: String,
    source: String,
    root: Vec<parse::Node>,
    funcs: Functions,
}

impl Template {
    /// Parses `text` with Go's builtin functions.
    pub fn parse(name: &str, text: &str) -> Result<Self, TemplateError> {
        Self::parse_with(name, text, Functions::default())
    }

    /// Parses `text`; it may call the functions in `funcs`.
    pub fn parse_with(name: &str, text: &str, funcs: Functions) -> Result<Self, TemplateError> {
        let root =
            parse::parse(text, &funcs).map_err(|fail| TemplateError::new(name, text, fail, Phase::Parse))?;
        Ok(Template { name: name.to_owned(), source: text.to_owned(), root, funcs })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Renders with `data` as dot and `$`.
    pub fn render(&self, data: &Value) -> Result<String, TemplateError> {
        exec::render(&self.funcs, &self.root, data)
            .map_err(|fail| TemplateError::new(&self.name, &self.source, fail, Phase::Exec))
    }
}
