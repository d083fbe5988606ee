//! Execution: walks a parsed tree over JSON data, with Go's "no value", truth, field lookup,
//! variables, `range` and `break`/`continue`, and calls functions with their arguments.

use serde_json::Value;

use super::error::{ErrorKind, Fail, call_err, syntax};
use super::format::{self, go_type};
use super::funcs::{Builtin, Func, Functions, builtin};
use super::parse::{Cmd, Cond, Node, Pipe, Range, Term};
use super::value::{Val, truth};

/// `.a.b` on `recv`: a missing key or "no value" gives "no value"; null or a non-object fails.
fn field_chain(recv: &Val, path: &[String], has_args: bool) -> Result<Val, ErrorKind> {
    let mut cur = match recv {
        Val::Missing => return Ok(Val::Missing),
        Val::Json(v) => v,
    };
    for (i, name) in path.iter().enumerate() {
        cur = match cur {
            Value::Object(_) if has_args && i + 1 == path.len() => {
                return Err(ErrorKind::Type(format!("{name} is not a method but has arguments")));
            }
            Value::Object(m) => match m.get(name) {
                Some(v) => v,
                None => return Ok(Val::Missing),
            },
            Value::Null => {
                return Err(ErrorKind::Type(format!("nil pointer evaluating interface {{}}.{name}")));
            }
            v => {
                return Err(ErrorKind::Type(format!("can't evaluate field {name} in type {}", go_type(v))));
            }
        };
    }
    Ok(Val::Json(cur.clone()))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    Normal,
    Break,
    Continue,
}

/// Renders the tree `root` with `data` as dot and `$`.
pub(super) fn render(funcs: &Functions, root: &[Node], data: &Value) -> Result<String, Fail> {
    let dot = Val::Json(data.clone());
    let mut exec = Exec { funcs, vars: vec![("$".into(), dot.clone())], out: String::new() };
    exec.walk(&dot, root)?;
    Ok(exec.out)
}

struct Exec<'t> {
    funcs: &'t Functions,
    /// Variables in scope, innermost last.
    vars: Vec<(String, Val)>,
    out: String,
}

impl Exec<'_> {
    fn walk(&mut self, dot: &Val, nodes: &[Node]) -> Result<Flow, Fail> {
        for node in nodes {
            let flow = match node {
                Node::Text(s) => {
                    self.out.push_str(s);
                    Flow::Normal
                }
                Node::Action(pipe) => {
                    let v = self.pipe(dot, pipe)?;
                    if pipe.decl.is_empty() {
                        match v {
                            Val::Missing => self.out.push_str("<no value>"),
                            Val::Json(v) => format::write_v(&mut self.out, &v),
                        }
                    }
                    Flow::Normal
                }
                Node::Cond(cond) => self.cond(dot, cond)?,
                Node::Range(range) => self.range(dot, range)?,
                Node::Break => Flow::Break,
                Node::Continue => Flow::Continue,
            };
            if flow != Flow::Normal {
                return Ok(flow);
            }
        }
        Ok(Flow::Normal)
    }

    fn cond(&mut self, dot: &Val, cond: &Cond) -> Result<Flow, Fail> {
        let mark = self.vars.len();
        let mut flow = None;
        for (pipe, body) in &cond.branches {
            let v = self.pipe(dot, pipe)?;
            if truth(&v) {
                flow = Some(if cond.with { self.walk(&v, body)? } else { self.walk(dot, body)? });
                break;
            }
        }
        let flow = match flow {
            Some(flow) => flow,
            None => self.walk(dot, &cond.otherwise)?,
        };
        self.vars.truncate(mark);
        Ok(flow)
    }

    fn range(&mut self, dot: &Val, range: &Range) -> Result<Flow, Fail> {
        let pipe = &range.pipe;
        let type_err = |message: String| Fail(ErrorKind::Type(message), pipe.pos);
        let mark = self.vars.len();
        let value = self.pipe(dot, pipe)?;
        let inner = self.vars.len();
        let mut keys: Vec<&String> = Vec::new();
        let count = match &value {
            Val::Missing => 0,
            Val::Json(Value::Array(a)) => a.len(),
            Val::Json(Value::Object(m)) => {
                keys = m.keys().collect();
                keys.sort();
                m.len()
            }
            Val::Json(Value::Number(n)) if n.is_i64() || n.is_u64() => {
                if pipe.decl.len() > 1 {
                    return Err(type_err(format!("can't use {n} to iterate over more than one variable")));
                }
                n.as_u64().and_then(|n| usize::try_from(n).ok()).unwrap_or(0)
            }
            Val::Json(v) => {
                let mut shown = String::new();
                format::write_v(&mut shown, v);
                return Err(type_err(format!("range can't iterate over {shown}")));
            }
        };
        if count == 0 {
            let flow = self.walk(dot, &range.otherwise)?;
            self.vars.truncate(mark);
            return Ok(flow);
        }
        for i in 0..count {
            let (key, elem) = match &value {
                Val::Json(Value::Array(a)) => (Value::from(i), a.get(i).cloned().unwrap_or_default()),
                Val::Json(Value::Object(m)) => {
                    let key = keys.get(i).map_or_else(String::new, |k| (*k).clone());
                    let elem = m.get(&key).cloned().unwrap_or_default();
                    (Value::String(key), elem)
                }
                _ => (Value::from(i), Value::from(i)),
            };
            let elem = Val::Json(elem);
            match pipe.decl.as_slice() {
                [v] => self.bind(v, elem.clone(), pipe.assign, pipe.pos)?,
                [k, v] => {
                    self.bind(k, Val::Json(key), pipe.assign, pipe.pos)?;
                    self.bind(v, elem.clone(), pipe.assign, pipe.pos)?;
                }
                _ => {}
            }
            let flow = self.walk(&elem, &range.body)?;
            self.vars.truncate(inner);
            if flow == Flow::Break {
                break;
            }
        }
        self.vars.truncate(mark);
        Ok(Flow::Normal)
    }

    /// Declares (`:=`) or assigns (`=`) a variable.
    fn bind(&mut self, name: &str, v: Val, assign: bool, pos: usize) -> Result<(), Fail> {
        if !assign {
            self.vars.push((name.to_owned(), v));
            return Ok(());
        }
        let slot = self.vars.iter_mut().rev().find(|(n, _)| n == name);
        let slot = slot.ok_or_else(|| Fail(ErrorKind::UndefinedVariable(name.to_owned()), pos))?;
        slot.1 = v;
        Ok(())
    }

    fn var(&self, name: &str, pos: usize) -> Result<&Val, Fail> {
        let found = self.vars.iter().rev().find(|(n, _)| n == name);
        found.map(|(_, v)| v).ok_or_else(|| Fail(ErrorKind::UndefinedVariable(name.to_owned()), pos))
    }

    /// Runs a pipeline and binds its declared variables.
    fn pipe(&mut self, dot: &Val, pipe: &Pipe) -> Result<Val, Fail> {
        let mut last = None;
        for cmd in &pipe.cmds {
            let v = self.command(dot, cmd, last.take())?;
            // Go digs into a result of type interface{}: a nil one becomes "no value".
            last = Some(if v == Val::Json(Value::Null) { Val::Missing } else { v });
        }
        let v = last.unwrap_or(Val::Missing);
        for name in &pipe.decl {
            self.bind(name, v.clone(), pipe.assign, pipe.pos)?;
        }
        Ok(v)
    }

    /// One command; `fin` is the previous command's value, passed as the last argument.
    fn command(&mut self, dot: &Val, cmd: &Cmd, fin: Option<Val>) -> Result<Val, Fail> {
        let at = |kind| Fail(kind, cmd.pos);
        let Some((head, rest)) = cmd.args.split_first() else {
            return Err(at(syntax("empty command")));
        };
        let has_args = !rest.is_empty() || fin.is_some();
        match head {
            Term::Func(name) => self.call(dot, name, rest, fin, cmd.pos),
            Term::Field(path) => field_chain(dot, path, has_args).map_err(at),
            Term::Var(name, path) if !path.is_empty() => {
                field_chain(self.var(name, cmd.pos)?, path, has_args).map_err(at)
            }
            Term::Sub(pipe, path) if !path.is_empty() => {
                let v = self.pipe(dot, pipe)?;
                field_chain(&v, path, has_args).map_err(at)
            }
            _ if has_args => Err(at(ErrorKind::Type("can't give argument to non-function".into()))),
            Term::Nil => Err(at(ErrorKind::Type("nil is not a command".into()))),
            term => self.arg(dot, term, cmd.pos),
        }
    }

    /// An operand's value as a function argument.
    fn arg(&mut self, dot: &Val, term: &Term, pos: usize) -> Result<Val, Fail> {
        let at = |kind| Fail(kind, pos);
        match term {
            Term::Dot => Ok(dot.clone()),
            Term::Nil => Ok(Val::Missing),
            Term::Lit(v) => Ok(Val::Json(v.clone())),
            Term::Field(path) => field_chain(dot, path, false).map_err(at),
            Term::Var(name, path) if path.is_empty() => self.var(name, pos).cloned(),
            Term::Var(name, path) => field_chain(self.var(name, pos)?, path, false).map_err(at),
            Term::Func(name) => self.call(dot, name, &[], None, pos),
            Term::Sub(pipe, path) => {
                let v = self.pipe(dot, pipe)?;
                if path.is_empty() { Ok(v) } else { field_chain(&v, path, false).map_err(at) }
            }
        }
    }

    fn call(
        &mut self,
        dot: &Val,
        name: &str,
        args: &[Term],
        fin: Option<Val>,
        pos: usize,
    ) -> Result<Val, Fail> {
        let at = |kind| Fail(kind, pos);
        let func = self.funcs.get(name).ok_or_else(|| at(ErrorKind::UnknownFunction(name.into())))?;
        let arity = match func {
            Func::Builtin(b) => b.arity(),
            Func::Custom(arity, _) => *arity,
        };
        let got = args.len() + usize::from(fin.is_some());
        if !arity.accepts(got) {
            return Err(at(ErrorKind::ArgCount { func: name.into(), want: arity, got }));
        }
        if let Func::Builtin(b @ (Builtin::And | Builtin::Or)) = func {
            // Short-circuit: the first argument that decides is the result.
            let decides = *b == Builtin::Or;
            let mut last = Val::Missing;
            for a in args {
                last = self.arg(dot, a, pos)?;
                if truth(&last) == decides {
                    return Ok(last);
                }
            }
            return Ok(fin.unwrap_or(last));
        }
        let mut vals = Vec::with_capacity(got);
        for a in args {
            vals.push(self.arg(dot, a, pos)?);
        }
        vals.extend(fin);
        match func {
            Func::Builtin(b) => builtin(*b, name, vals).map_err(at),
            Func::Custom(_, f) => {
                let plain: Vec<Value> = vals.into_iter().map(Val::into_value).collect();
                f(&plain).map(Val::Json).map_err(|message| at(call_err(name, message)))
            }
        }
    }
}
