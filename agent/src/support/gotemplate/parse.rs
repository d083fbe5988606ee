//! The parser: tokens to the tree that [`super::exec`] walks, checking functions and variables
//! as Go's parser does. Holds the tree's types too.

use serde_json::Value;

use super::error::{ErrorKind, Fail, syntax};
use super::funcs::Functions;
use super::lex::{EOF, Tok, Token, lex};

#[derive(Debug, Clone)]
pub(super) enum Node {
    Text(String),
    /// `{{pipeline}}`: printed unless it declares or assigns variables.
    Action(Pipe),
    /// `if`/`with` with its `else if`/`else with` chain, flattened.
    Cond(Cond),
    Range(Range),
    Break,
    Continue,
}

#[derive(Debug, Clone)]
pub(super) struct Cond {
    pub(super) with: bool,
    pub(super) branches: Vec<(Pipe, Vec<Node>)>,
    pub(super) otherwise: Vec<Node>,
}

#[derive(Debug, Clone)]
pub(super) struct Range {
    pub(super) pipe: Pipe,
    pub(super) body: Vec<Node>,
    pub(super) otherwise: Vec<Node>,
}

#[derive(Debug, Clone)]
pub(super) struct Pipe {
    pub(super) pos: usize,
    pub(super) decl: Vec<String>,
    pub(super) assign: bool,
    pub(super) cmds: Vec<Cmd>,
}

#[derive(Debug, Clone)]
pub(super) struct Cmd {
    pub(super) pos: usize,
    pub(super) args: Vec<Term>,
}

/// An operand; the `Vec<String>` parts are field chains (`.a.b`, `$x.a`, `(pipe).a`).
#[derive(Debug, Clone)]
pub(super) enum Term {
    Dot,
    Nil,
    Lit(Value),
    Field(Vec<String>),
    Var(String, Vec<String>),
    Func(String),
    Sub(Box<Pipe>, Vec<String>),
}

// ---------------------------------------------------------------------------------------------
// Parser

const KEYWORDS: [&str; 10] =
    ["block", "break", "continue", "define", "else", "end", "if", "range", "template", "with"];

/// How deep control structures and parentheses may nest.
const MAX_DEPTH: usize = 100;

/// Parses `text` into its tree, checking that what it calls is in `funcs`.
pub(super) fn parse(text: &str, funcs: &Functions) -> Result<Vec<Node>, Fail> {
    let mut parser =
        Parser { toks: lex(text), at: 0, funcs, vars: vec!["$".into()], range_depth: 0, depth: 0 };
    match parser.list()? {
        (nodes, Stop::Eof, _) => Ok(nodes),
        (_, Stop::End, pos) => Err(Fail(ErrorKind::Unexpected("{{end}}".into()), pos)),
        (_, Stop::Else, pos) => Err(Fail(ErrorKind::Unexpected("{{else}}".into()), pos)),
    }
}

/// Why a list of nodes ended.
enum Stop {
    Eof,
    End,
    Else,
}

enum Step {
    Node(Node),
    Stop(Stop),
}

struct Parser<'a> {
    toks: Vec<Token>,
    at: usize,
    funcs: &'a Functions,
    /// Variables in scope, innermost last; `$` always.
    vars: Vec<String>,
    range_depth: usize,
    depth: usize,
}

fn starts_operand(tok: &Tok) -> bool {
    matches!(
        tok,
        Tok::Dot | Tok::Nil | Tok::Lit(_) | Tok::Field(_) | Tok::Var(_) | Tok::Ident(_) | Tok::LParen
    )
}

fn describe(tok: &Tok) -> String {
    match tok {
        Tok::Text(_) => "text".into(),
        Tok::Open => "\"{{\"".into(),
        Tok::Close => "\"}}\"".into(),
        Tok::Field(n) => format!("<.{n}>"),
        Tok::Dot => "<.>".into(),
        Tok::Var(n) | Tok::Ident(n) => format!("<{n}>"),
        Tok::Lit(v) => format!("<{v}>"),
        Tok::Nil => "<nil>".into(),
        Tok::LParen => "\"(\"".into(),
        Tok::RParen => "\")\"".into(),
        Tok::Pipe => "\"|\"".into(),
        Tok::Declare => "\":=\"".into(),
        Tok::Assign => "\"=\"".into(),
        Tok::Comma => "\",\"".into(),
        Tok::Eof => "EOF".into(),
        Tok::Error(kind) => kind.to_string(),
    }
}

fn unexpected(t: &Token, context: &str) -> Fail {
    match &t.tok {
        Tok::Error(kind) => Fail(kind.clone(), t.pos),
        tok => Fail(ErrorKind::Unexpected(format!("{} in {context}", describe(tok))), t.pos),
    }
}

impl Parser<'_> {
    fn peek(&self) -> &Token {
        self.toks.get(self.at).unwrap_or(&EOF)
    }

    fn next(&mut self) -> Result<Token, Fail> {
        let t = self.peek().clone();
        self.at += 1;
        match t.tok {
            Tok::Error(kind) => Err(Fail(kind, t.pos)),
            _ => Ok(t),
        }
    }

    fn expect_close(&mut self, context: &str) -> Result<(), Fail> {
        let t = self.next()?;
        if t.tok == Tok::Close { Ok(()) } else { Err(unexpected(&t, context)) }
    }

    fn nest(&mut self, pos: usize) -> Result<(), Fail> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(Fail(syntax(format!("nesting deeper than {MAX_DEPTH} levels")), pos));
        }
        Ok(())
    }

    /// Nodes up to the end of input or an `{{end}}`/`{{else`; also the position of that stop.
    fn list(&mut self) -> Result<(Vec<Node>, Stop, usize), Fail> {
        let mut nodes = Vec::new();
        loop {
            let t = self.next()?;
            match t.tok {
                Tok::Text(s) => nodes.push(Node::Text(s)),
                Tok::Eof => return Ok((nodes, Stop::Eof, t.pos)),
                Tok::Open => match self.action(t.pos)? {
                    Step::Node(n) => nodes.push(n),
                    Step::Stop(stop) => return Ok((nodes, stop, t.pos)),
                },
                _ => return Err(unexpected(&t, "input")),
            }
        }
    }

    /// What follows an `{{`.
    fn action(&mut self, pos: usize) -> Result<Step, Fail> {
        let word = match &self.peek().tok {
            Tok::Ident(w) if KEYWORDS.contains(&w.as_str()) => w.clone(),
            _ => {
                let pipe = self.pipeline("command", false)?;
                self.expect_close("command")?;
                return Ok(Step::Node(Node::Action(pipe)));
            }
        };
        self.next()?;
        let node = match word.as_str() {
            "end" => {
                self.expect_close("end")?;
                return Ok(Step::Stop(Stop::End));
            }
            "else" => return Ok(Step::Stop(Stop::Else)),
            "if" | "with" => self.cond(word == "with", pos)?,
            "range" => self.range(pos)?,
            "break" | "continue" => {
                if self.range_depth == 0 {
                    return Err(Fail(syntax(format!("{{{{{word}}}}} outside {{{{range}}}}")), pos));
                }
                self.expect_close(&word)?;
                if word == "break" { Node::Break } else { Node::Continue }
            }
            _ => return Err(Fail(ErrorKind::Unsupported(word), pos)),
        };
        Ok(Step::Node(node))
    }

    fn cond(&mut self, with: bool, pos: usize) -> Result<Node, Fail> {
        let context = if with { "with" } else { "if" };
        self.nest(pos)?;
        let mark = self.vars.len();
        let mut branches = Vec::new();
        let otherwise = loop {
            let pipe = self.pipeline(context, false)?;
            self.expect_close(context)?;
            let (body, stop, _) = self.list()?;
            branches.push((pipe, body));
            match stop {
                Stop::End => break Vec::new(),
                Stop::Eof => return Err(Fail(ErrorKind::Unclosed(context), pos)),
                Stop::Else if matches!(&self.peek().tok, Tok::Ident(w) if w == context) => {
                    self.next()?;
                }
                Stop::Else => break self.else_tail(context, pos)?,
            }
        };
        self.vars.truncate(mark);
        self.depth -= 1;
        Ok(Node::Cond(Cond { with, branches, otherwise }))
    }

    fn range(&mut self, pos: usize) -> Result<Node, Fail> {
        self.nest(pos)?;
        let mark = self.vars.len();
        let pipe = self.pipeline("range", false)?;
        self.expect_close("range")?;
        self.range_depth += 1;
        let (body, stop, _) = self.list()?;
        self.range_depth -= 1;
        let otherwise = match stop {
            Stop::End => Vec::new(),
            Stop::Eof => return Err(Fail(ErrorKind::Unclosed("range"), pos)),
            Stop::Else => self.else_tail("range", pos)?,
        };
        self.vars.truncate(mark);
        self.depth -= 1;
        Ok(Node::Range(Range { pipe, body, otherwise }))
    }

    /// The rest of a plain `{{else}}`: its `}}` and the nodes up to `{{end}}`.
    fn else_tail(&mut self, context: &'static str, pos: usize) -> Result<Vec<Node>, Fail> {
        self.expect_close("else")?;
        let (nodes, stop, at) = self.list()?;
        match stop {
            Stop::End => Ok(nodes),
            Stop::Eof => Err(Fail(ErrorKind::Unclosed(context), pos)),
            Stop::Else => Err(Fail(syntax("expected end; found {{else}}"), at)),
        }
    }

    /// A pipeline up to `}}` (or `)` when `in_parens`), which is left unread.
    fn pipeline(&mut self, context: &str, in_parens: bool) -> Result<Pipe, Fail> {
        let pos = self.peek().pos;
        let (decl, assign) = self.declarations(context)?;
        let mut cmds = Vec::new();
        loop {
            let t = self.peek();
            match t.tok {
                Tok::Close if !in_parens => break,
                Tok::RParen if in_parens => break,
                Tok::Close => return Err(Fail(syntax("unclosed left paren"), t.pos)),
                Tok::RParen => return Err(Fail(syntax("unexpected right paren"), t.pos)),
                ref tok if starts_operand(tok) => cmds.push(self.command()?),
                _ => return Err(unexpected(t, context)),
            }
        }
        if cmds.is_empty() {
            return Err(Fail(syntax(format!("missing value for {context}")), pos));
        }
        let non_executable = |c: &Cmd| matches!(c.args.first(), Some(Term::Dot | Term::Nil | Term::Lit(_)));
        if let Some(i) = cmds.iter().skip(1).position(non_executable) {
            return Err(Fail(syntax(format!("non executable command in pipeline stage {}", i + 2)), pos));
        }
        if !assign {
            self.vars.extend(decl.iter().cloned());
        }
        Ok(Pipe { pos, decl, assign, cmds })
    }

    /// `$x :=`, `$x =`, or in a range `$i, $v :=`, at the start of a pipeline.
    fn declarations(&mut self, context: &str) -> Result<(Vec<String>, bool), Fail> {
        let pos = self.peek().pos;
        let ahead: Vec<&Tok> = self.toks.iter().skip(self.at).take(4).map(|t| &t.tok).collect();
        let (names, assign) = match ahead.as_slice() {
            [Tok::Var(a), op @ (Tok::Declare | Tok::Assign), ..] => (vec![a.clone()], **op == Tok::Assign),
            [Tok::Var(a), Tok::Comma, Tok::Var(b), op @ (Tok::Declare | Tok::Assign)]
                if context == "range" =>
            {
                (vec![a.clone(), b.clone()], **op == Tok::Assign)
            }
            [Tok::Var(_), Tok::Comma, ..] if context == "range" => {
                return Err(Fail(syntax("range can only initialize variables"), pos));
            }
            [Tok::Var(_), Tok::Comma, ..] => {
                return Err(Fail(syntax(format!("too many declarations in {context}")), pos));
            }
            _ => return Ok((Vec::new(), false)),
        };
        self.at += names.len() * 2;
        if let Some(undeclared) = names.iter().find(|n| assign && !self.vars.contains(n)) {
            return Err(Fail(ErrorKind::UndefinedVariable(undeclared.clone()), pos));
        }
        Ok((names, assign))
    }

    /// Space-separated operands up to `|`, `}}` or `)`.
    fn command(&mut self) -> Result<Cmd, Fail> {
        let pos = self.peek().pos;
        let mut args = vec![self.operand()?];
        loop {
            let t = self.peek();
            match t.tok {
                Tok::Close | Tok::RParen => break,
                Tok::Pipe => {
                    self.next()?;
                    break;
                }
                ref tok if t.spaced && starts_operand(tok) => args.push(self.operand()?),
                _ => return Err(unexpected(t, "operand")),
            }
        }
        Ok(Cmd { pos, args })
    }

    /// A term and the fields chained onto it without spaces.
    fn operand(&mut self) -> Result<Term, Fail> {
        let mut term = self.term()?;
        while let Token { tok: Tok::Field(name), pos, spaced: false } = self.peek() {
            let (name, pos) = (name.clone(), *pos);
            self.at += 1;
            term = match term {
                Term::Field(mut path) => {
                    path.push(name);
                    Term::Field(path)
                }
                Term::Var(var, mut path) => {
                    path.push(name);
                    Term::Var(var, path)
                }
                Term::Sub(pipe, mut path) => {
                    path.push(name);
                    Term::Sub(pipe, path)
                }
                Term::Func(f) => {
                    let call = Cmd { pos, args: vec![Term::Func(f)] };
                    Term::Sub(
                        Box::new(Pipe { pos, decl: Vec::new(), assign: false, cmds: vec![call] }),
                        vec![name],
                    )
                }
                Term::Dot | Term::Nil | Term::Lit(_) => {
                    return Err(Fail(syntax("unexpected . after term"), pos));
                }
            };
        }
        Ok(term)
    }

    fn term(&mut self) -> Result<Term, Fail> {
        let t = self.next()?;
        Ok(match t.tok {
            Tok::Dot => Term::Dot,
            Tok::Nil => Term::Nil,
            Tok::Lit(v) => Term::Lit(v),
            Tok::Field(name) => Term::Field(vec![name]),
            Tok::Var(name) if self.vars.contains(&name) => Term::Var(name, Vec::new()),
            Tok::Var(name) => return Err(Fail(ErrorKind::UndefinedVariable(name), t.pos)),
            Tok::Ident(name) if KEYWORDS.contains(&name.as_str()) => {
                return Err(Fail(ErrorKind::Unexpected(format!("<{name}> in operand")), t.pos));
            }
            Tok::Ident(name) if self.funcs.contains(&name) => Term::Func(name),
            Tok::Ident(name) => return Err(Fail(ErrorKind::UnknownFunction(name), t.pos)),
            Tok::LParen => {
                self.nest(t.pos)?;
                let pipe = self.pipeline("parenthesized pipeline", true)?;
                self.next()?;
                self.depth -= 1;
                Term::Sub(Box::new(pipe), Vec::new())
            }
            tok => {
                return Err(Fail(ErrorKind::Unexpected(format!("{} in operand", describe(&tok))), t.pos));
            }
        })
    }
}
