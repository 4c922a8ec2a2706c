"""The job server's routes, one APIRouter per area; jobserver/app.py `create_app` composes them.

    state.py      JobsState: what every route shares (store, runner, confiner, limits, ...), passed in
    auth.py       the bearer-token dependency every /v1 route takes
    health.py     GET /health (no token)
    jobs.py       create, list, get, cancel, resume, delete
    watch.py      a job's logs and its server-sent event stream
    artifacts.py  a job's files: the list and one file's bytes
    publish.py    a finished adapter onto a running `lmforge serve`
    rating.py     human evaluation: blind side-by-side rating studies, their results and the /rate page

The dashboard (the page at / and /static) is jobserver/dashboard.py.
"""
