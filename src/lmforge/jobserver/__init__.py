"""`lmforge jobs`: a REST job server (FastAPI) that runs lmforge verbs as tracked, cancellable,
resumable processes for authenticated users. server.py starts it; app.py holds the routes."""
