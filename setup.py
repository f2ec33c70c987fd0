import os

from setuptools import find_packages
from setuptools import setup

here = os.path.dirname(os.path.abspath(__file__))


def read(name):
    with open(os.path.join(here, name), encoding='utf-8') as f:
        return f.read()


version = {}
exec(read('relstorage/__init__.py'), version)

postgresql = ['psycopg[binary] >= 3.1', 'psycopg2-binary']
mysql = ['mysqlclient', 'PyMySQL']
oracle = ['oracledb']
# hiredis: the redis client's fast reply parser, used when installed.
redis = ['redis', 'hiredis']

setup(
    name='relstorage',
    version=version['__version__'],
    description='A ZODB storage that keeps pickles in a relational database',
    long_description=read('README.txt') + '\n\n' + read('CHANGES.txt'),
    long_description_content_type='text/x-rst',
    license='ZPL-2.1',
    python_requires='>=3.10',
    packages=find_packages(include=['relstorage', 'relstorage.*']),
    package_data={'relstorage': ['component.xml'], 'relstorage.tests': ['configs/*.conf']},
    include_package_data=True,
    zip_safe=False,
    install_requires=[
        'ZODB >= 6',
        'ZConfig',
        'zope.interface',
        'persistent',
        'BTrees',
        'transaction',
    ],
    extras_require={
        'postgresql': postgresql,
        'mysql': mysql,
        'oracle': oracle,
        'memcache': ['pymemcache'],
        'redis': redis,
        # zodbpack's progress display on a terminal (optional).
        'progress': ['tqdm>=4.42'],
        'test': ['zope.testrunner', 'zope.testing', 'manuel', 'ZEO', 'zodburi', 'zc.zlibstorage'] + postgresql + mysql + ['pymemcache', 'tqdm>=4.42']
                + redis + oracle + ['sqlglot', 'gevent'],
    },
    entry_points={
        'console_scripts': [
            'zodbconvert = relstorage.zodbconvert:main',
            'zodbpack = relstorage.zodbpack:main',
        ],
        'zodburi.resolvers': [
            'postgres = relstorage.zodburi:postgresql_resolver',
            'postgresql = relstorage.zodburi:postgresql_resolver',
            'mysql = relstorage.zodburi:mysql_resolver',
            'sqlite = relstorage.zodburi:sqlite_resolver',
            'sqlite3 = relstorage.zodburi:sqlite_resolver',
            'oracle = relstorage.zodburi:oracle_resolver',
        ],
    },
    classifiers=[
        'Framework :: ZODB',
        'Programming Language :: Python :: 3',
        'Topic :: Database',
    ],
)
