//! Errors: what went wrong ([`ErrorKind`], worded as Go words it), where ([`TemplateError`]:
//! template name, line and column) and in which [`Phase`]; plus [`Fail`], an error still at a
//! byte offset, as the lexer, parser and executor raise it.

use super::arity::Arity;

/// Whether an error was found while parsing or while rendering.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Parse,
    Exec,
}

/// What went wrong, worded as Go words it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ErrorKind {
    #[error("unclosed action")]
    UnclosedAction,
    #[error("unclosed comment")]
    UnclosedComment,
    #[error("unexpected EOF: {{{{{0}}}}} has no matching {{{{end}}}}")]
    Unclosed(&'static str),
    #[error("unexpected {0}")]
    Unexpected(String),
    #[error("function {0:?} not defined")]
    UnknownFunction(String),
    #[error("undefined variable {0:?}")]
    UndefinedVariable(String),
    #[error("{{{{{0}}}}} is not supported")]
    Unsupported(String),
    #[error("{0}")]
    Syntax(String),
    #[error("wrong number of args for {func}: want {want} got {got}")]
    ArgCount { func: String, want: Arity, got: usize },
    #[error("error calling index: index out of range: {0}")]
    IndexOutOfRange(i128),
    #[error("error calling {func}: {message}")]
    Call { func: String, message: String },
    #[error("{0}")]
    Type(String),
}

/// A parse or render failure: the template, where in it, and what.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("template: {name}:{line}:{col}: {}{kind}", exec_prefix(.phase, .name))]
pub struct TemplateError {
    pub name: String,
    pub line: usize,
    pub col: usize,
    pub phase: Phase,
    pub kind: ErrorKind,
}

fn exec_prefix(phase: &Phase, name: &str) -> String {
    match phase {
        Phase::Parse => String::new(),
        Phase::Exec => format!("executing {name:?}: "),
    }
}

/// An error at a byte offset of the source, before it is given a line and column.
#[derive(Debug)]
pub(super) struct Fail(pub(super) ErrorKind, pub(super) usize);

impl TemplateError {
    pub(super) fn new(name: &str, src: &str, Fail(kind, pos): Fail, phase: Phase) -> Self {
        let before = src.get(..pos).unwrap_or(src);
        let line = before.matches('\n').count() + 1;
        let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        TemplateError { name: name.to_owned(), line, col, phase, kind }
    }
}

pub(super) fn syntax(message: impl Into<String>) -> ErrorKind {
    ErrorKind::Syntax(message.into())
}

pub(super) fn call_err(func: &str, message: impl Into<String>) -> ErrorKind {
    ErrorKind::Call { func: func.to_owned(), message: message.into() }
}
